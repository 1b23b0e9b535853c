// checkpoint_bench: how fast a checkpoint opens, validates and is read through
// the mmap'd tensor views, against a plain sequential read() of the same files
// measured in the same run (the baseline). Warm page cache: both passes read
// files that the generator (or a previous pass) just touched.
//
//   checkpoint_bench [--model DIR | --size tiny|mid --work_dir DIR] [--iterations N]
//
// Prints figures, then ONE JSON line: {"bench":"checkpoint_load",...}.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "engine/model/checkpoint.h"
#include "engine/model/make_checkpoint.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "Existing checkpoint directory (skips generation).");
ABSL_FLAG(std::string, size, "mid", "Generated model size when --model is empty.");
ABSL_FLAG(std::string, work_dir, "/tmp/tandem_checkpoint_bench",
          "Where to generate the checkpoint (reused when already present).");
ABSL_FLAG(int, iterations, 3, "Measured repetitions; the best one is reported.");

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Sequential read() of every file with a 4 MiB buffer; returns a byte sum.
uint64_t ReadFiles(const std::vector<std::string>& paths, uint64_t* bytes) {
  std::vector<char> buf(4 << 20);
  uint64_t sum = 0;
  *bytes = 0;
  for (const std::string& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ssize_t n;
    while ((n = ::read(fd, buf.data(), buf.size())) > 0) {
      *bytes += static_cast<uint64_t>(n);
      for (ssize_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v;
        std::memcpy(&v, buf.data() + i, 8);
        sum += v;
      }
    }
    ::close(fd);
  }
  return sum;
}

uint64_t SumView(const tandem::model::TensorView& v) {
  uint64_t sum = 0;
  size_t i = 0;
  for (; i + 8 <= v.nbytes; i += 8) {
    uint64_t x;
    std::memcpy(&x, v.data + i, 8);
    sum += x;
  }
  for (; i < v.nbytes; ++i) sum += v.data[i];
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "checkpoint_bench",
                      "checkpoint_bench [--model DIR | --size tiny|mid] [--iterations N]");
  std::string dir = absl::GetFlag(FLAGS_model);
  const std::string size = absl::GetFlag(FLAGS_size);
  double generate_ms = 0;
  if (dir.empty()) {
    dir = absl::GetFlag(FLAGS_work_dir) + "/" + size;
    if (!Exists(dir + "/model.safetensors.index.json")) {
      auto config = tandem::model::ConfigForSize(size);
      if (!config.ok()) {
        std::fprintf(stderr, "error: %s\n", config.status().ToString().c_str());
        return 2;
      }
      tandem::model::MakeCheckpointOptions options;
      options.out_dir = dir;
      options.config = *config;
      options.num_shards = size == "mid" ? 4 : 3;
      options.tokenizer_dir = "";  // weights only
      auto t0 = Clock::now();
      absl::Status s = tandem::model::MakeCheckpoint(options);
      generate_ms = Ms(t0, Clock::now());
      if (!s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
        return 1;
      }
      std::printf("generated %s checkpoint in %s: %.0f ms\n", size.c_str(), dir.c_str(),
                  generate_ms);
    }
  }

  const int iterations = std::max(1, absl::GetFlag(FLAGS_iterations));
  double best_open = 1e300, best_validate = 1e300, best_touch = 1e300, best_read = 1e300;
  uint64_t tensor_bytes = 0, file_bytes = 0, tensors = 0, files = 0;
  uint64_t checksum = 0;
  for (int it = 0; it < iterations; ++it) {
    auto t0 = Clock::now();
    auto ckpt = tandem::model::Checkpoint::Open(dir);
    auto t1 = Clock::now();
    if (!ckpt.ok()) {
      std::fprintf(stderr, "error: %s\n", ckpt.status().ToString().c_str());
      return 1;
    }
    absl::Status valid = (*ckpt)->ValidateAgainstConfig();
    auto t2 = Clock::now();
    if (!valid.ok()) {
      std::fprintf(stderr, "error: %s\n", valid.ToString().c_str());
      return 1;
    }
    uint64_t sum = 0;
    tensor_bytes = 0;
    const auto names = (*ckpt)->tensors().Names();
    for (const std::string& name : names) {
      auto v = (*ckpt)->tensors().Get(name);
      sum += SumView(*v);
      tensor_bytes += v->nbytes;
    }
    auto t3 = Clock::now();
    tensors = names.size();
    std::vector<std::string> paths;
    for (const auto& f : (*ckpt)->tensors().files()) paths.push_back(f->path());
    files = paths.size();
    ckpt->reset();  // unmap before the baseline

    auto r0 = Clock::now();
    uint64_t read_sum = ReadFiles(paths, &file_bytes);
    auto r1 = Clock::now();
    checksum ^= sum ^ read_sum;

    best_open = std::min(best_open, Ms(t0, t1));
    best_validate = std::min(best_validate, Ms(t1, t2));
    best_touch = std::min(best_touch, Ms(t2, t3));
    best_read = std::min(best_read, Ms(r0, r1));
    std::printf("iteration %d: open %.2f ms, validate %.2f ms, touch %.2f ms, read() %.2f ms\n",
                it, Ms(t0, t1), Ms(t1, t2), Ms(t2, t3), Ms(r0, r1));
  }
  const double load_ms = best_open + best_validate + best_touch;
  const double mb = static_cast<double>(tensor_bytes) / 1e6;
  const double load_mbps = mb / (load_ms / 1e3);
  const double read_mbps = static_cast<double>(file_bytes) / 1e6 / (best_read / 1e3);
  std::printf("checkpoint %s: %llu files, %llu tensors, %.1f MB of tensors\n", dir.c_str(),
              static_cast<unsigned long long>(files), static_cast<unsigned long long>(tensors),
              mb);
  std::printf("open+validate+touch: %.2f ms (%.0f MB/s); read() baseline %.2f ms "
              "(%.0f MB/s); ratio %.2f\n",
              load_ms, load_mbps, best_read, read_mbps, load_mbps / read_mbps);
  nlohmann::json line = {{"bench", "checkpoint_load"},
                         {"model", dir},
                         {"size", absl::GetFlag(FLAGS_model).empty() ? size : "external"},
                         {"files", files},
                         {"tensors", tensors},
                         {"tensor_bytes", tensor_bytes},
                         {"file_bytes", file_bytes},
                         {"iterations", iterations},
                         {"generate_ms", generate_ms},
                         {"open_ms", best_open},
                         {"validate_ms", best_validate},
                         {"touch_ms", best_touch},
                         {"load_ms", load_ms},
                         {"load_mb_per_s", load_mbps},
                         {"read_baseline_ms", best_read},
                         {"read_baseline_mb_per_s", read_mbps},
                         {"load_vs_read", load_mbps / read_mbps},
                         {"checksum", checksum}};
  std::printf("%s\n", line.dump().c_str());
  return 0;
}
