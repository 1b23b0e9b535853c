// main() of the Google Benchmark binaries `./tandem bench` runs (metrics,
// sampler): BENCHMARK_MAIN()'s, with hyphenated flag names accepted as by every
// other Tandem binary (issue 16, item 5): `--benchmark-filter=BM_Greedy` is
// `--benchmark_filter=BM_Greedy`. Google Benchmark's flags are all
// `--benchmark_*` (and `--v`) and take their value after `=`, so only the name
// before `=` is rewritten; values and everything after `--` are left as given.
#include <algorithm>
#include <cstring>

#include "benchmark/benchmark.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) break;
    if (std::strncmp(argv[i], "--benchmark-", 12) != 0) continue;
    char* end = std::strchr(argv[i], '=');
    if (end == nullptr) end = argv[i] + std::strlen(argv[i]);
    std::replace(argv[i] + 2, end, '-', '_');
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
