#include "metrics/registry.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "metrics/buckets.h"
#include "metrics/names.h"

namespace tandem::metrics {
namespace {

// The names a family of `type` writes on sample lines, plus the family name.
std::vector<std::string> SeriesNames(absl::string_view name, MetricType type) {
  std::vector<std::string> names = {std::string(name)};
  if (type == MetricType::kHistogram) {
    names.push_back(absl::StrCat(name, "_bucket"));
    names.push_back(absl::StrCat(name, "_sum"));
    names.push_back(absl::StrCat(name, "_count"));
  }
  return names;
}

}  // namespace

Registry::Registry() = default;
Registry::~Registry() = default;

absl::StatusOr<FamilyBase*> Registry::FindCompatible(
    absl::string_view name, MetricType type, const std::vector<double>& buckets) const {
  for (const std::string& series : SeriesNames(name, type)) {
    auto it = series_.find(series);
    if (it == series_.end()) continue;
    FamilyBase* existing = it->second;
    if (existing->name() != name) {
      return absl::AlreadyExistsError(absl::StrCat(
          "metric ", name, " (", MetricTypeName(type), ") collides with series ",
          series, " of ", MetricTypeName(existing->type()), " ", existing->name()));
    }
    if (existing->type() != type) {
      return absl::AlreadyExistsError(absl::StrCat(
          "metric ", name, " is already registered as a ",
          MetricTypeName(existing->type()), ", not a ", MetricTypeName(type)));
    }
    if (existing->buckets() != buckets) {
      return absl::AlreadyExistsError(
          absl::StrCat("histogram ", name, " is already registered with buckets [",
                       absl::StrJoin(existing->buckets(), ", "), "], not [",
                       absl::StrJoin(buckets, ", "), "]"));
    }
    return existing;
  }
  return nullptr;
}

void Registry::Insert(std::unique_ptr<FamilyBase> family) {
  for (std::string& series : SeriesNames(family->name(), family->type())) {
    series_.emplace(std::move(series), family.get());
  }
  families_.push_back(std::move(family));
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(absl::string_view name,
                                                      absl::string_view help) {
  TANDEM_RETURN_IF_ERROR(ValidateMetricName(name));
  absl::MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(FamilyBase * existing,
                          FindCompatible(name, MetricType::kCounter, {}));
  if (existing != nullptr) return static_cast<Family<Counter>*>(existing);
  auto family = std::make_unique<Family<Counter>>(
      std::string(name), std::string(help), std::vector<double>{},
      [] { return std::make_unique<Counter>(); });
  Family<Counter>* result = family.get();
  Insert(std::move(family));
  return result;
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(absl::string_view name,
                                                  absl::string_view help) {
  TANDEM_RETURN_IF_ERROR(ValidateMetricName(name));
  absl::MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(FamilyBase * existing,
                          FindCompatible(name, MetricType::kGauge, {}));
  if (existing != nullptr) return static_cast<Family<Gauge>*>(existing);
  auto family = std::make_unique<Family<Gauge>>(
      std::string(name), std::string(help), std::vector<double>{},
      [] { return std::make_unique<Gauge>(); });
  Family<Gauge>* result = family.get();
  Insert(std::move(family));
  return result;
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(absl::string_view name,
                                                          absl::string_view help,
                                                          std::vector<double> buckets) {
  TANDEM_RETURN_IF_ERROR(ValidateMetricName(name));
  if (absl::Status s = ValidateBuckets(buckets); !s.ok()) {
    return InvalidArgument("histogram ", name, ": ", s.message());
  }
  absl::MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(FamilyBase * existing,
                          FindCompatible(name, MetricType::kHistogram, buckets));
  if (existing != nullptr) return static_cast<Family<Histogram>*>(existing);
  auto family = std::make_unique<Family<Histogram>>(
      std::string(name), std::string(help), buckets,
      [buckets] { return std::make_unique<Histogram>(buckets); });
  Family<Histogram>* result = family.get();
  Insert(std::move(family));
  return result;
}

std::vector<FamilySnapshot> Registry::Collect() const {
  absl::MutexLock lock(&mu_);
  std::vector<FamilySnapshot> out;
  out.reserve(families_.size());
  for (const auto& family : families_) out.push_back(family->Collect());
  return out;
}

void DieOnBadDefinition(const absl::Status& status) {
  std::fprintf(stderr, "tandem: bad metric definition: %s\n",
               status.ToString().c_str());
  std::abort();
}

}  // namespace tandem::metrics
