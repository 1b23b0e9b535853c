// A metric family: one name, help text and type, with one child metric per label
// set (e.g. tandem_requests_total{route="prefill"} and {route="decode"}).
//
//   Family<Counter>* f = *registry.AddCounter("tandem_requests_total", "Requests.");
//   Counter& prefill = f->Add({{"route", "prefill"}});   // look up once...
//   prefill.Increment();                                  // ...then hot path is
//   lock-free
//
// Add() takes the family's lock and hashes the label set: look children up once
// and keep the reference. The child lives as long as the family (families live as
// long as their Registry). The same label set, in any order, gives the same child;
// the exposition keeps the order of the first Add().
#ifndef TANDEM_METRICS_FAMILY_H_
#define TANDEM_METRICS_FAMILY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "metrics/counter.h"
#include "metrics/gauge.h"
#include "metrics/histogram.h"
#include "metrics/names.h"
#include "metrics/snapshot.h"

namespace tandem::metrics {

// The type-independent part of a family; what a Registry stores.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<double> buckets);
  virtual ~FamilyBase();
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  // Histogram bucket bounds (without +Inf); empty for other types.
  const std::vector<double>& buckets() const { return buckets_; }

  // A snapshot of every child, in the order their label sets were first added.
  virtual FamilySnapshot Collect() const = 0;

 protected:
  // Order-independent identity of a label set.
  static std::string LabelKey(const Labels& labels);
  // Logs an invalid-labels error, once per family.
  void ReportInvalidLabels(const absl::Status& status);

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<double> buckets_;
  std::atomic<bool> reported_invalid_{false};
};

template <typename T>
class Family final : public FamilyBase {
 public:
  using Factory = std::function<std::unique_ptr<T>()>;

  // Made by Registry::AddCounter/AddGauge/AddHistogram, which validate the name
  // and buckets. `factory` builds one child (a Histogram with the family's bounds).
  Family(std::string name, std::string help, std::vector<double> buckets,
         Factory factory)
      : FamilyBase(std::move(name), std::move(help), T::kType, std::move(buckets)),
        factory_(std::move(factory)) {}

  // The child for `labels`, created on first use. Invalid labels (bad or
  // duplicate names, "le" on a histogram, values that are not UTF-8) give an
  // InvalidArgument error.
  absl::StatusOr<T*> TryAdd(const Labels& labels);

  // Like TryAdd() for label sets known to be valid (literal names). On invalid
  // labels it logs an error (once per family) and returns a detached child that is
  // never exported, so a bad label cannot crash a serving process.
  T& Add(const Labels& labels);

  // Number of exported children.
  size_t size() const;

  FamilySnapshot Collect() const override;

 private:
  struct Child {
    Labels labels;
    std::unique_ptr<T> metric;
  };

  const Factory factory_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, size_t> index_ ABSL_GUARDED_BY(mu_);
  std::vector<Child> children_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<T> detached_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
absl::StatusOr<T*> Family<T>::TryAdd(const Labels& labels) {
  if (absl::Status s = ValidateLabels(labels, T::kType); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name(), ": ", s.message()));
  }
  std::string key = LabelKey(labels);
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = index_.try_emplace(std::move(key), children_.size());
  if (inserted) children_.push_back(Child{labels, factory_()});
  return children_[it->second].metric.get();
}

template <typename T>
T& Family<T>::Add(const Labels& labels) {
  absl::StatusOr<T*> child = TryAdd(labels);
  if (child.ok()) return **child;
  ReportInvalidLabels(child.status());
  absl::MutexLock lock(&mu_);
  if (detached_ == nullptr) detached_ = factory_();
  return *detached_;
}

template <typename T>
size_t Family<T>::size() const {
  absl::MutexLock lock(&mu_);
  return children_.size();
}

template <typename T>
FamilySnapshot Family<T>::Collect() const {
  FamilySnapshot out;
  out.name = name();
  out.help = help();
  out.type = type();
  absl::MutexLock lock(&mu_);
  out.metrics.reserve(children_.size());
  for (const Child& child : children_) {
    MetricSnapshot& m = out.metrics.emplace_back();
    m.labels = child.labels;
    child.metric->Collect(&m);
  }
  return out;
}

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_FAMILY_H_
