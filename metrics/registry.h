// The set of metric families one component exports. Injected, never global: a
// process makes one Registry (or one per component), passes it to the code that
// records metrics, and hands it to an HttpExposer. Families live as long as the
// Registry; the references Family::Add() returns stay valid as long too.
//
//   Registry registry;
//   TANDEM_ASSIGN_OR_RETURN(auto* requests,
//       registry.AddCounter("tandem_requests_total", "Requests received."));
//   TANDEM_ASSIGN_OR_RETURN(auto* ttft, registry.AddHistogram(
//       "tandem_time_to_first_token_seconds", "Time to first token.", buckets));
//
// Registering a name again with the same type (and, for histograms, the same
// buckets) returns the existing family (its first help text wins); a different
// type or different buckets is an AlreadyExists error, as is a name that collides
// with a histogram's series (a gauge "x_count" next to a histogram "x").
// Thread-safe.
#ifndef TANDEM_METRICS_REGISTRY_H_
#define TANDEM_METRICS_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "metrics/counter.h"
#include "metrics/family.h"
#include "metrics/gauge.h"
#include "metrics/histogram.h"
#include "metrics/snapshot.h"

namespace tandem::metrics {

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  absl::StatusOr<Family<Counter>*> AddCounter(absl::string_view name,
                                              absl::string_view help);
  absl::StatusOr<Family<Gauge>*> AddGauge(absl::string_view name,
                                          absl::string_view help);
  // `buckets`: finite, strictly increasing upper bounds; +Inf is implicit (see
  // ExponentialBuckets/LinearBuckets in buckets.h).
  absl::StatusOr<Family<Histogram>*> AddHistogram(absl::string_view name,
                                                  absl::string_view help,
                                                  std::vector<double> buckets);

  // A snapshot of every family (including those with no children yet), in
  // registration order.
  std::vector<FamilySnapshot> Collect() const;

 private:
  // Checks `name` against what is registered: returns the existing family with
  // the same name and compatible type/buckets, nullptr when the name is free, or
  // an error.
  absl::StatusOr<FamilyBase*> FindCompatible(absl::string_view name, MetricType type,
                                             const std::vector<double>& buckets) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Insert(std::unique_ptr<FamilyBase> family) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  // Every sample name a family writes (a histogram "x" writes x_bucket, x_sum,
  // x_count), mapped to that family.
  absl::flat_hash_map<std::string, FamilyBase*> series_ ABSL_GUARDED_BY(mu_);
};

// For metric definitions that are constants of the program (a fixed name, help
// and buckets): a registration error is a programming mistake, so it is logged to
// stderr with the status and the process aborts. Use the StatusOr form wherever a
// name comes from configuration.
//   Counter* c = &OrDie(registry.AddCounter("tandem_x_total", "X."))->Add({});
[[noreturn]] void DieOnBadDefinition(const absl::Status& status);

template <typename T>
T* OrDie(absl::StatusOr<T*> family) {
  if (!family.ok()) DieOnBadDefinition(family.status());
  return *family;
}

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_REGISTRY_H_
