// allreduce_bench: Gloo all-reduce over loopback TCP with ranks as threads of
// this process (the CPU worker's layout, parallel/ranks.h), next to a memcpy of
// the same buffer measured in the same run.
//
//   bazel run -c opt //parallel:allreduce_bench -- --ranks=2,4,8
//   --floats=7168,262144,4194304
//
// For each group size and buffer: warm-up, then timed all-reduces (rank 0's
// clock, between barriers). Reports time per call, algorithm bandwidth
// (bytes / time) and bus bandwidth (algbw * 2(n-1)/n, the bytes each rank moves
// in a ring), and a small-message latency (--latency_floats) per group size.
// 7168 floats is one K3 hidden vector: the all-reduce after each attention and
// FFN block in decode at batch 1. Ends with ONE JSON line {"bench":"allreduce",...}.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "nlohmann/json.hpp"
#include "parallel/ranks.h"

ABSL_FLAG(std::string, ranks, "2,4,8", "Group sizes, comma separated");
ABSL_FLAG(std::string, floats, "7168,262144,4194304",
          "Buffer sizes in floats, comma separated");
ABSL_FLAG(int, latency_floats, 4, "Floats per call in the latency run");
ABSL_FLAG(int, latency_calls, 300, "Calls timed in the latency run");
ABSL_FLAG(double, seconds, 0.5, "Approximate timed seconds per configuration");

namespace tandem::parallel {
namespace {

using nlohmann::json;

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) {
      std::fprintf(stderr, "bad list entry '%s'\n", std::string(part).c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

// Seconds per memcpy of `bytes` (best of several runs, warm buffers).
double MemcpySeconds(size_t bytes, int calls) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const absl::Time start = absl::Now();
    for (int i = 0; i < calls; ++i) {
      std::memcpy(b.data(), a.data(), bytes);
      a[i % bytes] = b[(i * 7) % bytes];  // keep the copies observable
    }
    best = std::min(best, absl::ToDoubleSeconds(absl::Now() - start) / calls);
  }
  return best;
}

// Seconds per all-reduce of `floats` values in a group of n (rank 0's view).
double AllReduceSeconds(int n, size_t floats, int calls) {
  double seconds = 0;
  absl::Status s = RunRanks(n, [&](Communicator& comm) -> absl::Status {
    std::vector<float> data(floats, 1.0f);
    for (int i = 0; i < 2; ++i) {  // warm-up: connections, buffers
      if (auto st = comm.AllReduceSum(data.data(), floats); !st.ok()) return st;
    }
    if (auto st = comm.Barrier(); !st.ok()) return st;
    const absl::Time start = absl::Now();
    for (int i = 0; i < calls; ++i) {
      std::fill(data.begin(), data.begin() + std::min<size_t>(floats, 4), 1.0f);
      if (auto st = comm.AllReduceSum(data.data(), floats); !st.ok()) return st;
    }
    if (auto st = comm.Barrier(); !st.ok()) return st;
    if (comm.rank() == 0) {
      seconds = absl::ToDoubleSeconds(absl::Now() - start) / calls;
      if (data[0] != static_cast<float>(n)) {
        return absl::InternalError("all-reduce result is wrong");
      }
    }
    return absl::OkStatus();
  });
  if (!s.ok()) {
    std::fprintf(stderr, "all-reduce failed: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  return seconds;
}

int Main() {
  const std::vector<int64_t> ranks = ParseList(absl::GetFlag(FLAGS_ranks));
  const std::vector<int64_t> sizes = ParseList(absl::GetFlag(FLAGS_floats));
  const double budget = absl::GetFlag(FLAGS_seconds);
  json results = json::array();
  json memcpy_results = json::array();
  json latency = json::object();

  for (int64_t floats : sizes) {
    const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
    const int calls = static_cast<int>(
        std::clamp<double>(budget * 2e9 / static_cast<double>(bytes), 5, 100000));
    const double t = MemcpySeconds(bytes, calls);
    std::fprintf(stderr, "memcpy %10zu B: %9.2f us  %7.2f GB/s\n", bytes, t * 1e6,
                 bytes / t / 1e9);
    memcpy_results.push_back(
        {{"bytes", bytes}, {"us", t * 1e6}, {"gbps", bytes / t / 1e9}});
  }
  for (int64_t n : ranks) {
    const int lat_floats = absl::GetFlag(FLAGS_latency_floats);
    const double lat = AllReduceSeconds(static_cast<int>(n), lat_floats,
                                        absl::GetFlag(FLAGS_latency_calls));
    std::fprintf(stderr, "ranks %2lld latency (%d floats): %9.1f us\n",
                 static_cast<long long>(n), lat_floats, lat * 1e6);
    latency[std::to_string(n)] = lat * 1e6;
    for (int64_t floats : sizes) {
      const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
      // A first estimate sets the call count for about --seconds.
      const double probe = AllReduceSeconds(static_cast<int>(n), floats, 3);
      const int calls =
          static_cast<int>(std::clamp(budget / std::max(probe, 1e-7), 3.0, 5000.0));
      const double t = AllReduceSeconds(static_cast<int>(n), floats, calls);
      const double algbw = bytes / t / 1e9;
      const double busbw = algbw * 2.0 * (n - 1) / n;
      std::fprintf(stderr,
                   "ranks %2lld %10zu B: %9.1f us  algbw %6.2f GB/s  busbw "
                   "%6.2f GB/s  (%d calls)\n",
                   static_cast<long long>(n), bytes, t * 1e6, algbw, busbw, calls);
      results.push_back({{"ranks", n},
                         {"bytes", bytes},
                         {"us", t * 1e6},
                         {"algbw_gbps", algbw},
                         {"busbw_gbps", busbw},
                         {"calls", calls}});
    }
  }
  json out = {{"bench", "allreduce"},
              {"transport", "gloo-tcp-loopback"},
              {"ranks_as", "threads"},
              {"hardware_threads", std::thread::hardware_concurrency()},
              {"latency_floats", absl::GetFlag(FLAGS_latency_floats)},
              {"latency_us", latency},
              {"memcpy", memcpy_results},
              {"allreduce", results}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace tandem::parallel

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "allreduce_bench",
                      "allreduce_bench [--ranks=2,4,8] [--floats=...] "
                      "[--seconds=0.5]");
  return tandem::parallel::Main();
}
