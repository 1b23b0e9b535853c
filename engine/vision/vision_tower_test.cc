// The tower against a plain reference written here from VISION.md section 2
// (fp64 loops over the checkpoint's tensors, read directly: no code shared with
// the tower or the kernels), on the tiny checkpoint's tower and random patches.
#include "engine/vision/vision_tower.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/model/bf16.h"
#include "engine/model/checkpoint.h"
#include "engine/model/vision_config.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "nlohmann/json.hpp"

namespace tandem::vision {
namespace {

constexpr char kTiny[] = "engine/model/tiny_checkpoint";

using Mat = std::vector<double>;

// ---- The reference ---------------------------------------------------------------

struct Ref {
  const model::Checkpoint& ckpt;
  model::VisionConfig c;

  Mat Get(const std::string& name) const {
    auto v = ckpt.Get(name);
    EXPECT_TRUE(v.ok()) << v.status();
    auto f = v->ToFloat();
    return Mat(f->begin(), f->end());
  }
  // y[n, out] = x[n, in] W[out, in]^T
  static Mat Linear(const Mat& x, const Mat& w, int64_t n, int64_t in, int64_t out) {
    Mat y(n * out, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t k = 0; k < in; ++k) s += x[i * in + k] * w[o * in + k];
        y[i * out + o] = s;
      }
    return y;
  }
  static Mat Rms(const Mat& x, const Mat& w, int64_t n, int64_t d, double eps) {
    Mat y(x.size());
    for (int64_t i = 0; i < n; ++i) {
      double ss = 0;
      for (int64_t k = 0; k < d; ++k) ss += x[i * d + k] * x[i * d + k];
      const double r = 1.0 / std::sqrt(ss / d + eps);
      for (int64_t k = 0; k < d; ++k) y[i * d + k] = x[i * d + k] * r * w[k];
    }
    return y;
  }
  // Bilinear, align_corners = false, from the PyTorch definition.
  static double Src(int64_t o, int64_t in, int64_t out) {
    const double s = (o + 0.5) * static_cast<double>(in) / out - 0.5;
    return s < 0 ? 0 : s;
  }

  // One image: [gh*gw, 3p²] → [N, Ht].
  Mat Encode(const media::PatchedImage& im) const {
    const int64_t D = c.vt_hidden_size, Q = c.qkv_hidden_size,
                  nh = c.vt_num_attention_heads;
    const int64_t hd = Q / nh, I = c.vt_intermediate_size, pd = c.patch_dim();
    const int64_t gh = im.grid_h, gw = im.grid_w, n = gh * gw;
    Mat px(n * pd);
    for (int64_t i = 0; i < n * pd; ++i) {
      px[i] = model::Bf16ToFloat(model::FloatToBf16(im.patches[i]));
    }
    Mat x = Linear(px, Get("vision_tower.patch_embed.proj.weight"), n, pd, D);
    const Mat table = Get("vision_tower.patch_embed.pos_emb.weight");
    const int64_t H0 = c.init_pos_emb_height, W0 = c.init_pos_emb_width;
    for (int64_t r = 0; r < gh; ++r)
      for (int64_t col = 0; col < gw; ++col) {
        const double sr = (gh == H0 && gw == W0) ? r : Src(r, H0, gh);
        const double sc = (gh == H0 && gw == W0) ? col : Src(col, W0, gw);
        const int64_t r0 = static_cast<int64_t>(std::floor(sr)),
                      c0 = static_cast<int64_t>(std::floor(sc));
        const int64_t r1 = std::min(r0 + 1, H0 - 1), c1 = std::min(c0 + 1, W0 - 1);
        const double lr = sr - r0, lc = sc - c0;
        for (int64_t k = 0; k < D; ++k) {
          auto T = [&](int64_t a, int64_t b) { return table[(a * W0 + b) * D + k]; };
          x[(r * gw + col) * D + k] +=
              (1 - lr) * ((1 - lc) * T(r0, c0) + lc * T(r0, c1)) +
              lr * ((1 - lc) * T(r1, c0) + lc * T(r1, c1));
        }
      }
    for (int64_t l = 0; l < c.vt_num_hidden_layers; ++l) {
      const std::string b = absl::StrCat("vision_tower.encoder.blocks.", l, ".");
      Mat h = Rms(x, Get(b + "norm0.weight"), n, D, c.vt_norm_eps);
      Mat qkv = Linear(h, Get(b + "wqkv.weight"), n, D, 3 * Q);
      for (int64_t t = 0; t < n; ++t) {
        const double row = t / gw, col = t % gw;
        for (int64_t part = 0; part < 2; ++part)
          for (int64_t hh = 0; hh < nh; ++hh)
            for (int64_t i = 0; i < hd / 4; ++i) {
              const double f = std::pow(c.vt_rope_theta, -4.0 * i / hd);
              for (int half = 0; half < 2; ++half) {
                const double phi = (half == 0 ? col : row) * f;
                double* e = &qkv[t * 3 * Q + part * Q + hh * hd + 4 * i + 2 * half];
                const double a = e[0], bb = e[1];
                e[0] = a * std::cos(phi) - bb * std::sin(phi);
                e[1] = a * std::sin(phi) + bb * std::cos(phi);
              }
            }
      }
      Mat att(n * Q, 0.0);
      for (int64_t hh = 0; hh < nh; ++hh)
        for (int64_t t = 0; t < n; ++t) {
          std::vector<double> s(n);
          double mx = -1e300, den = 0;
          for (int64_t j = 0; j < n; ++j) {
            double dot = 0;
            for (int64_t k = 0; k < hd; ++k)
              dot += qkv[t * 3 * Q + hh * hd + k] * qkv[j * 3 * Q + Q + hh * hd + k];
            s[j] = dot / std::sqrt(static_cast<double>(hd));
            mx = std::max(mx, s[j]);
          }
          for (double& v : s) den += (v = std::exp(v - mx));
          for (int64_t k = 0; k < hd; ++k) {
            double acc = 0;
            for (int64_t j = 0; j < n; ++j)
              acc += s[j] * qkv[j * 3 * Q + 2 * Q + hh * hd + k];
            att[t * Q + hh * hd + k] = acc / den;
          }
        }
      Mat o = Linear(att, Get(b + "wo.weight"), n, Q, D);
      for (int64_t i = 0; i < n * D; ++i) x[i] += o[i];
      h = Rms(x, Get(b + "norm1.weight"), n, D, c.vt_norm_eps);
      Mat f = Linear(h, Get(b + "mlp.fc0.weight"), n, D, I);
      for (double& v : f)
        v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      o = Linear(f, Get(b + "mlp.fc1.weight"), n, I, D);
      for (int64_t i = 0; i < n * D; ++i) x[i] += o[i];
    }
    x = Rms(x, Get("vision_tower.encoder.final_layernorm.weight"), n, D, c.vt_norm_eps);
    const int64_t N = n / 4, M4 = 4 * D, Ht = c.text_hidden_size;
    Mat m(N * M4);
    for (int64_t R = 0; R < gh / 2; ++R)
      for (int64_t C = 0; C < gw / 2; ++C) {
        const int64_t src[4] = {2 * R * gw + 2 * C, 2 * R * gw + 2 * C + 1,
                                (2 * R + 1) * gw + 2 * C, (2 * R + 1) * gw + 2 * C + 1};
        for (int p = 0; p < 4; ++p)
          for (int64_t k = 0; k < D; ++k)
            m[(R * (gw / 2) + C) * M4 + p * D + k] = x[src[p] * D + k];
      }
    Mat h = Linear(m, Get("mm_projector.proj.0.weight"), N, M4, M4);
    for (double& v : h) v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    Mat e = Linear(h, Get("mm_projector.proj.2.weight"), N, M4, Ht);
    return Rms(e, Get("mm_projector.post_norm.weight"), N, Ht, c.projector_ln_eps);
  }
};

media::PatchedImage RandomImage(int gh, int gw, uint32_t seed) {
  media::PatchedImage im;
  im.grid_h = gh;
  im.grid_w = gw;
  im.patch_size = 14;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  im.patches.resize(static_cast<size_t>(gh) * gw * 588);
  for (float& v : im.patches) v = u(rng);
  im.content_hash = seed;
  return im;
}

// max |got - want| / max |want| over the whole output.
double NormErr(const std::vector<float>& got, const Mat& want, size_t offset = 0) {
  double mx = 0, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    mx = std::max(mx, std::fabs(want[i]));
    err = std::max(err, std::fabs(got[offset + i] - want[i]));
  }
  return err / mx;
}

class VisionTowerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = model::Checkpoint::Open(kTiny);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(ckpt).value();
  }
  std::unique_ptr<model::Checkpoint> ckpt_;
};

TEST_F(VisionTowerTest, MatchesThePlainReference) {
  auto vc = model::VisionConfigOf(ckpt_->config());
  ASSERT_TRUE(vc.ok()) << vc.status();
  Ref ref{*ckpt_, *vc};
  // VISION.md section 4's grids: 8x8 (the table as is), 4x8, 8x10, 16x2 (the
  // table both up- and down-sampled).
  const media::PatchedImage images[] = {RandomImage(8, 8, 1), RandomImage(4, 8, 2),
                                        RandomImage(8, 10, 3), RandomImage(16, 2, 4)};
  std::vector<Mat> want;
  for (const auto& im : images) want.push_back(ref.Encode(im));
  // Bounds (max error over max |want|): cpu_reference (fp64 accumulation, fp32
  // activations between ops) and "cpu" (fp32 GEMM products) 1e-5, measured
  // ~1e-7 and ~3e-7 (fp32 rounding of activations between ops); "cpu_bf16" rounds
  // GEMM inputs to BF16 (2^-9 relative per product, kernels/README.md) through
  // 2 blocks + projector: 3e-2 (measured ~5e-3).
  // The GPU backends run it from device memory (weights uploaded, activations
  // there): "cuda_sim" (the emulator; its GEMMs fp32-exact as "cpu"), "cuda"
  // where built and visible: 2e-5, measured ~6e-6 on the emulator: their
  // attention runs on tensor cores with split-BF16 operands (hi + lo, 2^-16 of
  // each value at worst; kernels/cuda/vision.cu), 20x the fp32 kernel's ~3e-7.
  // "cuda_sim_bf16" with cpu_bf16's bound.
  for (auto [name, bound] : {std::pair<const char*, double>{"cpu_reference", 1e-5},
                             {"cpu", 1e-5},
                             {"cpu_bf16", 3e-2},
                             {"cuda_sim", 2e-5},
                             {"cuda_sim_bf16", 3e-2},
                             {"cuda", 2e-5}}) {
    auto be = kernels::CreateBackend(name);
    if (!be.ok() && absl::StartsWith(name, "cuda")) {
      std::printf("%s: not in this build or no GPU (%s)\n", name,
                  std::string(be.status().message()).c_str());
      continue;
    }
    ASSERT_TRUE(be.ok()) << be.status();
    auto tower = VisionTower::Load(*ckpt_, be->get());
    ASSERT_TRUE(tower.ok()) << tower.status();
    std::vector<const media::PatchedImage*> batch;
    for (const auto& im : images) batch.push_back(&im);
    auto got = (*tower)->Encode(batch);
    ASSERT_TRUE(got.ok()) << got.status();
    size_t rows = 0;
    for (const auto& im : images) rows += im.num_tokens();
    EXPECT_EQ(rows, 16u + 8 + 20 + 8);
    ASSERT_EQ(got->size(), rows * vc->text_hidden_size);
    size_t off = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double err = NormErr(*got, want[i], off);
      EXPECT_LE(err, bound) << name << " image " << i;
      std::printf("%s image %zu: max err / max|want| = %.3g\n", name, i, err);
      off += want[i].size();
    }
  }
}

TEST_F(VisionTowerTest, ChangingOneImageChangesOnlyItsRows) {
  auto be = kernels::CreateBackend("cpu");
  ASSERT_TRUE(be.ok());
  auto tower = VisionTower::Load(*ckpt_, be->get());
  ASSERT_TRUE(tower.ok()) << tower.status();
  const media::PatchedImage a = RandomImage(8, 10, 5), b = RandomImage(4, 8, 6);
  media::PatchedImage b2 = b;
  b2.patches[100] = -b2.patches[100] + 0.5f;
  auto ab = (*tower)->Encode({&a, &b});
  auto ab2 = (*tower)->Encode({&a, &b2});
  auto alone = (*tower)->Encode({&a});
  ASSERT_TRUE(ab.ok() && ab2.ok() && alone.ok());
  const size_t rows_a = a.num_tokens() * 64;
  ASSERT_EQ(ab->size(), rows_a + b.num_tokens() * 64);
  for (size_t i = 0; i < rows_a; ++i) ASSERT_EQ((*ab)[i], (*ab2)[i]) << i;
  bool changed = false;
  for (size_t i = rows_a; i < ab->size(); ++i) changed |= (*ab)[i] != (*ab2)[i];
  EXPECT_TRUE(changed);
  // And an image's rows do not depend on its batch (GEMM blocking aside).
  double err = 0;
  for (size_t i = 0; i < rows_a; ++i)
    err = std::max(err, static_cast<double>(std::fabs((*ab)[i] - (*alone)[i])));
  EXPECT_LE(err, 1e-4);
}

TEST_F(VisionTowerTest, BadImagesAreInvalidArgument) {
  auto be = kernels::CreateBackend("cpu");
  ASSERT_TRUE(be.ok());
  auto tower = VisionTower::Load(*ckpt_, be->get());
  ASSERT_TRUE(tower.ok());
  media::PatchedImage odd = RandomImage(3, 4, 1), short_patches = RandomImage(4, 4, 1);
  short_patches.patches.pop_back();
  media::PatchedImage wrong_p = RandomImage(2, 2, 1);
  wrong_p.patch_size = 16;
  for (const media::PatchedImage* im : {&odd, &short_patches, &wrong_p}) {
    EXPECT_EQ((*tower)->Encode({im}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  auto none = (*tower)->Encode({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

// On a device backend the tower uploads its weights once and runs every call
// in one device buffer it keeps (reserved at load by the worker, which sets the
// weights and that buffer aside from its cache budget; grown only by a larger
// call); the host backends keep the mapping's views and free each call's.
TEST_F(VisionTowerTest, DeviceBackendsHoldTheWeightsAndOneCallBuffer) {
  auto cpu = kernels::CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  auto on_host = VisionTower::Load(*ckpt_, cpu->get());
  ASSERT_TRUE(on_host.ok()) << on_host.status();
  EXPECT_EQ((*on_host)->weight_device_bytes(), 0);

  auto be = kernels::CreateBackend("cuda_sim");
  if (!be.ok()) GTEST_SKIP() << "no cuda_sim in this build";
  kernels::Device& dev = (*be)->device();
  const int64_t before = dev.MemoryInfo().allocated_bytes;
  auto tower = VisionTower::Load(*ckpt_, be->get());
  ASSERT_TRUE(tower.ok()) << tower.status();
  // The tiny tower's tensors: patch embed, 2 blocks, the projector.
  const model::VisionConfig& c = (*tower)->config();
  const int64_t D = c.vt_hidden_size, Q = c.qkv_hidden_size, I = c.vt_intermediate_size;
  const int64_t M4 = c.merged_dim(), Ht = c.text_hidden_size;
  const int64_t want = 2 * (D * c.patch_dim() +
                            c.vt_num_hidden_layers * (3 * Q * D + D * Q + 2 * I * D) +
                            M4 * M4 + Ht * M4) +
                       4 * (c.vt_num_hidden_layers * 2 * D + D + Ht);
  EXPECT_EQ((*tower)->weight_device_bytes(), want);
  EXPECT_GE(dev.MemoryInfo().allocated_bytes - before, want);
  const int64_t loaded = dev.MemoryInfo().allocated_bytes;
  const media::PatchedImage a = RandomImage(8, 10, 5), small = RandomImage(4, 4, 6);
  auto rows = (*tower)->Encode({&a});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->size(), static_cast<size_t>(a.num_tokens() * Ht));
  // The call's buffer stays, exactly its size (patches, positions, table rows,
  // every activation), and a smaller call reuses it.
  const int64_t call = (*tower)->ActivationBytes(80, 1);
  EXPECT_GE(call, 80 * (c.patch_dim() + 3 * D + 4 * Q + I) * 4);
  EXPECT_GE(dev.MemoryInfo().allocated_bytes - loaded, call);
  EXPECT_LT(dev.MemoryInfo().allocated_bytes - loaded, call + 4096);
  const int64_t after_first = dev.MemoryInfo().allocated_bytes;
  ASSERT_TRUE((*tower)->Encode({&small}).ok());
  EXPECT_EQ(dev.MemoryInfo().allocated_bytes, after_first);
  // Reserved ahead for larger calls (as the worker does at load): no growth.
  auto held = (*tower)->ReserveActivations(400, 3);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, (*tower)->ActivationBytes(400, 3));
  const int64_t reserved = dev.MemoryInfo().allocated_bytes;
  const media::PatchedImage big = RandomImage(20, 20, 7);
  ASSERT_TRUE((*tower)->Encode({&big}).ok());
  EXPECT_EQ(dev.MemoryInfo().allocated_bytes, reserved);
  tower->reset();
  EXPECT_EQ(dev.MemoryInfo().allocated_bytes, before);
}

// Images beyond max_patches_per_call() are encoded in several calls: the rows
// are those of one call (up to GEMM blocking by row count, as above), and on a
// device the kept buffer is that of the largest group, not of all the images.
TEST_F(VisionTowerTest, ImagesBeyondOneCallsPatchesAreEncodedInGroups) {
  auto be = kernels::CreateBackend("cpu");
  ASSERT_TRUE(be.ok());
  auto tower = VisionTower::Load(*ckpt_, be->get());
  ASSERT_TRUE(tower.ok()) << tower.status();
  const media::PatchedImage a = RandomImage(8, 10, 5), b = RandomImage(4, 8, 6),
                            c = RandomImage(6, 6, 7);
  auto one = (*tower)->Encode({&a, &b, &c});
  ASSERT_TRUE(one.ok()) << one.status();
  // 80 + 32 + 36 patches: groups [a], [b, c] with 70; [a], [b], [c] with 16.
  for (int64_t limit : {70, 16}) {
    (*tower)->set_max_patches_per_call(limit);
    auto grouped = (*tower)->Encode({&a, &b, &c});
    ASSERT_TRUE(grouped.ok()) << grouped.status();
    ASSERT_EQ(grouped->size(), one->size());
    double err = 0;
    for (size_t i = 0; i < one->size(); ++i)
      err = std::max(err, static_cast<double>(std::fabs((*grouped)[i] - (*one)[i])));
    EXPECT_LE(err, 1e-4) << limit;
  }

  auto sim = kernels::CreateBackend("cuda_sim");
  if (!sim.ok()) return;  // a --config=cuda build
  auto on_device = VisionTower::Load(*ckpt_, sim->get());
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  kernels::Device& dev = (*sim)->device();
  const int64_t loaded = dev.MemoryInfo().allocated_bytes;
  (*on_device)->set_max_patches_per_call(70);  // [a] (80), [b, c] (32 + 36)
  auto grouped = (*on_device)->Encode({&a, &b, &c});
  ASSERT_TRUE(grouped.ok()) << grouped.status();
  const int64_t largest = std::max((*on_device)->ActivationBytes(80, 1),
                                   (*on_device)->ActivationBytes(68, 2));
  ASSERT_LT(largest, (*on_device)->ActivationBytes(148, 3));
  EXPECT_GE(dev.MemoryInfo().allocated_bytes - loaded, largest);
  EXPECT_LT(dev.MemoryInfo().allocated_bytes - loaded,
            (*on_device)->ActivationBytes(148, 3));
  double err = 0;
  for (size_t i = 0; i < one->size(); ++i)
    err = std::max(err, static_cast<double>(std::fabs((*grouped)[i] - (*one)[i])));
  EXPECT_LE(err, 1e-4);
}

// A checkpoint whose vision_config disagrees with its tensors: the error names
// the tensor and both shapes.
TEST_F(VisionTowerTest, ShapeMismatchNamesTheTensor) {
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/mismatch");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const char* files[] = {"generation_config.json", "model.safetensors.index.json",
                         "model-00001-of-00003.safetensors",
                         "model-00002-of-00003.safetensors",
                         "model-00003-of-00003.safetensors"};
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  for (const char* f : files) {
    ASSERT_EQ(::symlink(absl::StrCat(cwd, "/", kTiny, "/", f).c_str(),
                        absl::StrCat(dir, "/", f).c_str()),
              0);
  }
  std::ifstream in(absl::StrCat(kTiny, "/config.json"));
  nlohmann::json j = nlohmann::json::parse(in);
  j["vision_config"]["vt_intermediate_size"] = 256;
  std::ofstream(absl::StrCat(dir, "/config.json")) << j.dump(2);
  auto ckpt = model::Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto w = LoadVisionWeights(**ckpt);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(
      std::string(w.status().message())
          .find(
              "'vision_tower.encoder.blocks.0.mlp.fc0.weight': expected BF16[256,64], "
              "got BF16[128,64]"),
      std::string::npos)
      << w.status();
}

TEST(PosEmbTest, IdentityAtTheTableSizeAndBilinearElsewhere) {
  // A 2x2 table of one channel: 0 1 / 2 3. Resized to 4x4 (align_corners
  // false): row sources -0.25→0, 0.25, 0.75, 1.25→clamped neighbour.
  const std::vector<float> t = {0, 1, 2, 3};
  EXPECT_EQ(InterpolatePosEmb(t, 2, 2, 1, 2, 2), t);
  const std::vector<float> up = InterpolatePosEmb(t, 2, 2, 1, 4, 4);
  // Row 1 (src 0.25), column 2 (src 0.75): (1-.25)*((1-.75)*0 + .75*1) +
  // .25*((1-.75)*2 + .75*3) = 0.5625 + 0.6875 = 1.25.
  EXPECT_FLOAT_EQ(up[1 * 4 + 2], 1.25f);
  EXPECT_FLOAT_EQ(up[0], 0.0f);
  EXPECT_FLOAT_EQ(up[15], 3.0f);
  // Down to 1x1: source (0.5, 0.5) → the mean.
  EXPECT_FLOAT_EQ(InterpolatePosEmb(t, 2, 2, 1, 1, 1)[0], 1.5f);
}

}  // namespace
}  // namespace tandem::vision
