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

// Sums bytes as little-endian u64 words (four independent accumulators so the
// loop streams memory rather than waiting on one add chain); the same function
// serves the mmap pass and the read() baseline.
uint64_t SumBytes(const uint8_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    a += w[0];
    b += w[1];
    c += w[2];
    d += w[3];
  }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
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
      sum += SumBytes(reinterpret_cast<const uint8_t*>(buf.data()),
                      static_cast<size_t>(n));
    }
    ::close(fd);
  }
  return sum;
}

uint64_t SumView(const tandem::model::TensorView& v) {
  return SumBytes(v.data, v.nbytes);
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "checkpoint_bench",
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
  // Two ways to map: lazy (a page fault per 4 KiB on first touch) and
  // MAP_POPULATE (faulted in bulk during open). Best of `iterations` each.
  struct Mode {
    const char* name;
    bool populate;
    double open = 1e300, validate = 1e300, touch = 1e300;
  };
  Mode modes[] = {{"lazy", false}, {"populate", true}};
  double best_read = 1e300;
  uint64_t tensor_bytes = 0, file_bytes = 0, tensors = 0, files = 0;
  uint64_t checksum = 0;
  for (int it = 0; it < iterations; ++it) {
    std::vector<std::string> paths;
    for (Mode& mode : modes) {
      tandem::model::MapOptions map_options;
      map_options.populate = mode.populate;
      auto t0 = Clock::now();
      auto ckpt = tandem::model::Checkpoint::Open(dir, map_options);
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
      checksum ^= sum;
      tensors = names.size();
      paths.clear();
      for (const auto& f : (*ckpt)->tensors().files()) paths.push_back(f->path());
      files = paths.size();
      ckpt->reset();  // unmap
      mode.open = std::min(mode.open, Ms(t0, t1));
      mode.validate = std::min(mode.validate, Ms(t1, t2));
      mode.touch = std::min(mode.touch, Ms(t2, t3));
      std::printf("iteration %d %-8s: open %.2f ms, validate %.2f ms, touch %.2f ms\n",
                  it, mode.name, Ms(t0, t1), Ms(t1, t2), Ms(t2, t3));
    }
    auto r0 = Clock::now();
    checksum ^= ReadFiles(paths, &file_bytes);
    auto r1 = Clock::now();
    best_read = std::min(best_read, Ms(r0, r1));
    std::printf("iteration %d read()   : %.2f ms\n", it, Ms(r0, r1));
  }
  const double mb = static_cast<double>(tensor_bytes) / 1e6;
  const double read_mbps = static_cast<double>(file_bytes) / 1e6 / (best_read / 1e3);
  std::printf("checkpoint %s: %llu files, %llu tensors, %.1f MB of tensors\n",
              dir.c_str(), static_cast<unsigned long long>(files),
              static_cast<unsigned long long>(tensors), mb);
  nlohmann::json line = {
      {"bench", "checkpoint_load"},
      {"model", dir},
      {"size", absl::GetFlag(FLAGS_model).empty() ? size : "external"},
      {"files", files},
      {"tensors", tensors},
      {"tensor_bytes", tensor_bytes},
      {"file_bytes", file_bytes},
      {"iterations", iterations},
      {"generate_ms", generate_ms},
      {"read_baseline_ms", best_read},
      {"read_baseline_mb_per_s", read_mbps},
      {"checksum", checksum}};
  for (const Mode& mode : modes) {
    const double load_ms = mode.open + mode.validate + mode.touch;
    const double load_mbps = mb / (load_ms / 1e3);
    std::printf(
        "%-8s open+validate+touch: %.2f ms (%.0f MB/s) vs read() %.2f ms (%.0f MB/s): "
        "%.2fx\n",
        mode.name, load_ms, load_mbps, best_read, read_mbps, load_mbps / read_mbps);
    const std::string p = mode.name;
    line[p + "_open_ms"] = mode.open;
    line[p + "_validate_ms"] = mode.validate;
    line[p + "_touch_ms"] = mode.touch;
    line[p + "_load_ms"] = load_ms;
    line[p + "_load_mb_per_s"] = load_mbps;
    line[p + "_vs_read"] = load_mbps / read_mbps;
  }
  std::printf("%s\n", line.dump().c_str());
  return 0;
}
