// ./tandem bench vision: images/s and tower latency (tower + projector, one image
// per call) for 448x448, 1024x1024 and 1920x1080 inputs on the tiny tower
// (VISION.md section 4) and the mid tower (make-checkpoint --size mid), random
// weights generated in memory exactly as make-checkpoint writes them; then the
// tower's own GEMM shapes (M = the 448x448 image's 1024 patches) against the
// engine bench's yardsticks (oneDNN f32 / oneDNN bf16 / OpenBLAS f32) in the
// same run. Ends with one JSON line.
//
// Grids follow VISION.md section 1 with the published media_proc_cfg
// (in_patch_limit 65536): 448x448 -> 32x32 patches (256 tokens), 1024x1024 ->
// 74x74 (1369), 1920x1080 -> 78x138 (2691).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/media/patched_image.h"
#include "engine/model/make_checkpoint.h"
#include "engine/model/vision_config.h"
#include "engine/vision/vision_tower.h"
#include "kernels/backend_factory.h"
#include "kernels/gemm_yardstick.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, backend, "cpu", "kernel backend (cpu, cpu_bf16, cpu_reference)");
ABSL_FLAG(std::string, towers, "tiny,mid", "towers to time: tiny, mid");
ABSL_FLAG(double, min_seconds, 2.0,
          "time each image size at least this long (>= 1 run)");
ABSL_FLAG(bool, gemm_yardstick, true,
          "time the tower's GEMM shapes against the libraries");

namespace {

using tandem::media::PatchedImage;
using tandem::model::VisionConfig;

struct Input {
  const char* name;
  int width, height, grid_h, grid_w;
};
constexpr Input kInputs[] = {
    {"448x448", 448, 448, 32, 32},
    {"1024x1024", 1024, 1024, 74, 74},
    {"1920x1080", 1920, 1080, 78, 138},
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "vision_bench: %s\n", std::string(s.message()).c_str());
  return 1;
}

// The tower's tensors generated as make-checkpoint does (seed 0), owned here.
struct OwnedWeights {
  std::vector<tandem::model::TensorData> data;
  tandem::vision::VisionWeights weights;
};

absl::StatusOr<OwnedWeights> MakeWeights(const tandem::model::ModelConfig& mc) {
  OwnedWeights o;
  TANDEM_ASSIGN_OR_RETURN(o.weights.config, tandem::model::VisionConfigOf(mc));
  const VisionConfig& c = o.weights.config;
  for (const auto& e : tandem::model::ExpectedVisionTensors(c)) {
    TANDEM_ASSIGN_OR_RETURN(auto t, tandem::model::GenerateTensor(mc, e, 0));
    o.data.push_back(std::move(t));
  }
  auto bits = [&](size_t i) {
    return reinterpret_cast<const uint16_t*>(o.data[i].bytes.data());
  };
  auto floats = [&](size_t i) {
    std::vector<float> v(o.data[i].bytes.size() / 2);
    for (size_t k = 0; k < v.size(); ++k) {
      const uint32_t b = static_cast<uint32_t>(bits(i)[k]) << 16;
      std::memcpy(&v[k], &b, 4);
    }
    return v;
  };
  size_t i = 0;
  auto& w = o.weights;
  w.patch_embed = bits(i++);
  w.pos_emb = floats(i++);
  w.blocks.resize(c.vt_num_hidden_layers);
  for (auto& b : w.blocks) {
    b.norm0 = floats(i++);
    b.norm1 = floats(i++);
    b.wqkv = bits(i++);
    b.wo = bits(i++);
    b.fc0 = bits(i++);
    b.fc1 = bits(i++);
  }
  w.final_norm = floats(i++);
  w.proj0 = bits(i++);
  w.proj2 = bits(i++);
  w.post_norm = floats(i++);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "vision_bench",
      "vision_bench [--backend cpu] [--towers tiny,mid] [--min_seconds S]");
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());
  nlohmann::json towers = nlohmann::json::array();
  std::vector<int64_t> yard_shapes_cfg;  // the mid (else tiny) tower's D, Q, I
  const std::vector<std::string> sizes =
      absl::StrSplit(absl::GetFlag(FLAGS_towers), ',');
  for (const std::string& size : sizes) {
    auto mc = tandem::model::ConfigForSize(size);
    if (!mc.ok()) return Fail(mc.status());
    auto owned = MakeWeights(*mc);
    if (!owned.ok()) return Fail(owned.status());
    const VisionConfig vc = owned->weights.config;
    // The weights stay owned by `owned` (the tower holds pointers into it).
    auto tower = tandem::vision::VisionTower::Create(owned->weights, backend->get());
    if (!tower.ok()) return Fail(tower.status());
    yard_shapes_cfg = {vc.vt_hidden_size, vc.qkv_hidden_size, vc.vt_intermediate_size};
    std::fprintf(stderr,
                 "%s tower: D %lld, Q %lld, %lld heads, I %lld, %lld layers, on %s\n",
                 size.c_str(), static_cast<long long>(vc.vt_hidden_size),
                 static_cast<long long>(vc.qkv_hidden_size),
                 static_cast<long long>(vc.vt_num_attention_heads),
                 static_cast<long long>(vc.vt_intermediate_size),
                 static_cast<long long>(vc.vt_num_hidden_layers),
                 std::string((*backend)->name()).c_str());
    nlohmann::json rows = nlohmann::json::array();
    for (const Input& in : kInputs) {
      PatchedImage im;
      im.grid_h = in.grid_h;
      im.grid_w = in.grid_w;
      im.patch_size = static_cast<int>(vc.patch_size);
      im.original_width = in.width;
      im.original_height = in.height;
      std::mt19937 rng(7);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      im.patches.resize(static_cast<size_t>(im.num_patches()) * im.patch_dim());
      for (float& v : im.patches) v = u(rng);
      std::vector<double> times;
      double total = 0;
      while (times.empty() || total < absl::GetFlag(FLAGS_min_seconds)) {
        const auto t0 = std::chrono::steady_clock::now();
        auto out = (*tower)->Encode({&im});
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count();
        if (!out.ok()) return Fail(out.status());
        times.push_back(s);
        total += s;
        if (times.size() >= 50) break;
      }
      std::sort(times.begin(), times.end());
      const double best = times.front(), median = times[times.size() / 2];
      std::fprintf(stderr,
                   "  %-10s grid %3dx%-3d (%5d patches, %4d tokens): %8.1f ms median, "
                   "%8.1f ms best, %7.2f images/s (%zu runs)\n",
                   in.name, in.grid_h, in.grid_w, im.num_patches(), im.num_tokens(),
                   median * 1e3, best * 1e3, 1.0 / median, times.size());
      rows.push_back({{"input", in.name},
                      {"grid", {in.grid_h, in.grid_w}},
                      {"patches", im.num_patches()},
                      {"tokens", im.num_tokens()},
                      {"latency_ms_median", median * 1e3},
                      {"latency_ms_best", best * 1e3},
                      {"images_per_s", 1.0 / median},
                      {"runs", times.size()}});
    }
    towers.push_back({{"tower", size},
                      {"config", nlohmann::json::parse(vc.ToJson())},
                      {"results", rows}});
  }
  nlohmann::json gemm = nlohmann::json::object();
  if (absl::GetFlag(FLAGS_gemm_yardstick) && !yard_shapes_cfg.empty() &&
      (*backend)->device().host_addressable()) {
    const int64_t D = yard_shapes_cfg[0], Q = yard_shapes_cfg[1],
                  I = yard_shapes_cfg[2];
    const int64_t m = 1024;  // the 448x448 image's patches
    struct Shape {
      const char* name;
      int64_t n, k;
    } shapes[] = {{"wqkv", 3 * Q, D}, {"wo", D, Q}, {"fc0", I, D}, {"fc1", D, I}};
    std::fprintf(stderr,
                 "tower GEMMs (last tower), M = %lld, %s vs oneDNN f32 / oneDNN bf16 / "
                 "OpenBLAS f32 (ratio = yardstick time / ours):\n",
                 static_cast<long long>(m), std::string((*backend)->name()).c_str());
    double flops = 0, ours = 0, f32 = 0, bf16 = 0, blas = 0;
    for (const Shape& s : shapes) {
      const auto tm = tandem::kernels::TimeGemmShape(**backend, m, s.n, s.k, 0.15);
      flops += tm.flops;
      ours += tm.backend_s;
      f32 += tm.onednn_f32_s;
      bf16 += tm.onednn_bf16_s;
      blas += tm.openblas_f32_s;
      std::fprintf(stderr, "  %-5s %5lld x %5lld: %7.1f GFLOP/s  %.2f / %.2f / %.2f\n",
                   s.name, static_cast<long long>(s.n), static_cast<long long>(s.k),
                   tm.flops / tm.backend_s / 1e9, tm.onednn_f32_s / tm.backend_s,
                   tm.onednn_bf16_s / tm.backend_s, tm.openblas_f32_s / tm.backend_s);
    }
    gemm = {{"m", m},
            {"gflops", flops / ours / 1e9},
            {"vs_onednn_f32", f32 / ours},
            {"vs_onednn_bf16", bf16 / ours},
            {"vs_openblas_f32", blas / ours}};
    std::fprintf(stderr, "  all shapes: %.1f GFLOP/s  %.2f / %.2f / %.2f\n",
                 flops / ours / 1e9, f32 / ours, bf16 / ours, blas / ours);
  }
  nlohmann::json out;
  out["bench"] = "vision";
  out["backend"] = std::string((*backend)->name());
  out["towers"] = towers;
  out["tower_gemm"] = gemm;
  std::cout << out.dump() << "\n";
  return 0;
}
