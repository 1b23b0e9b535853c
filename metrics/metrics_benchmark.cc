// Hot-path costs: bazel run -c opt //metrics:metrics_benchmark
#include <string>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "metrics/buckets.h"
#include "metrics/registry.h"
#include "metrics/text_format.h"

namespace tandem::metrics {
namespace {

void BM_CounterIncrement(benchmark::State& state) {
  static Counter* counter = new Counter;
  for (auto _ : state) counter->Increment();
}
BENCHMARK(BM_CounterIncrement)->Threads(1)->Threads(2);

void BM_GaugeSet(benchmark::State& state) {
  static Gauge* gauge = new Gauge;
  double v = 0;
  for (auto _ : state) gauge->Set(v += 1);
}
BENCHMARK(BM_GaugeSet)->Threads(1);

void BM_HistogramObserve(benchmark::State& state) {
  static Histogram* histogram = new Histogram(*ExponentialBuckets(0.0005, 2, 20));
  double v = 0.0001;
  for (auto _ : state) {
    histogram->Observe(v);
    v = v > 600 ? 0.0001 : v * 1.7;
  }
}
BENCHMARK(BM_HistogramObserve)->Threads(1)->Threads(2);

void BM_FamilyAddLookup(benchmark::State& state) {
  Registry registry;
  auto* family = *registry.AddCounter("x_total", "x");
  for (int i = 0; i < 16; ++i)
    family->Add({{"route", absl::StrCat(i)}, {"code", "200"}});
  for (auto _ : state) {
    benchmark::DoNotOptimize(&family->Add({{"route", "7"}, {"code", "200"}}));
  }
}
BENCHMARK(BM_FamilyAddLookup);

// A scrape of 50 families x 4 children (half histograms with 20 buckets).
void BM_CollectAndSerialize(benchmark::State& state) {
  Registry registry;
  for (int f = 0; f < 50; ++f) {
    for (int c = 0; c < 4; ++c) {
      Labels labels = {{"worker", absl::StrCat(c)}};
      if (f % 2 == 0) {
        (*registry.AddCounter(absl::StrCat("c", f, "_total"), "help"))
            ->Add(labels)
            .Increment(c);
      } else {
        (*registry.AddHistogram(absl::StrCat("h", f, "_seconds"), "help",
                                *ExponentialBuckets(0.0005, 2, 20)))
            ->Add(labels)
            .Observe(0.01 * c);
      }
    }
  }
  size_t bytes = 0;
  for (auto _ : state) {
    std::string text = SerializeText(registry.Collect());
    bytes = text.size();
    benchmark::DoNotOptimize(text);
  }
  state.counters["bytes"] = bytes;
}
BENCHMARK(BM_CollectAndSerialize);

}  // namespace
}  // namespace tandem::metrics

// main(): //bench:benchmark_main (hyphenated flag names accepted).
