// Conformance of the optional vision-tower ops (Rope2d, Gelu, VisionAttention,
// Merge2x2; kernels/backend.h), in the pattern of conformance_test.cc: every
// backend that Supports() them runs the same inputs as the "cpu_reference" oracle
// (fp64 loops) and must agree within the bound stated at each test; the oracle
// itself is checked against known values. The GPU backends (cuda_sim here, cuda
// in the GPU check) run them as kernels (kernels/cuda/vision.cu). Part of
// //kernels:conformance_test.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/conformance_backends.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/staging_backend.h"

namespace tandem::kernels {
namespace {

constexpr Op kVisionOps[] = {Op::kRope2d, Op::kGelu, Op::kVisionAttention,
                             Op::kMerge2x2};

class VisionConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref_ = CreateReferenceBackend();
    be_ = MakeConformanceBackend(GetParam());
    ASSERT_NE(be_, nullptr) << GetParam();
    for (Op op : kVisionOps) {
      if (!be_->Supports(op)) {
        GTEST_SKIP() << GetParam() << " does not support " << OpName(op)
                     << " (VisionOpsAreRefusedWhereMissing checks the refusal)";
      }
    }
  }
  std::vector<float> Normal(int64_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  // Norm-wise attention bound (max error over max |want|): 2e-5 for fp32-class
  // backends (fp32 GEMM products, or the GPU's split-BF16 tensor-core operands);
  // 2e-2 where the GPU kernel rounds q, k, v and p to BF16 (2^-9 each).
  double AttentionBound() const { return GpuBf16Operands(GetParam()) ? 2e-2 : 2e-5; }
  std::mt19937 rng_{777};
  std::unique_ptr<Backend> ref_;
  std::unique_ptr<Backend> be_;
};

// max_i |got - want| / (1 + |want_i|) <= bound.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 double bound, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e =
        std::fabs(static_cast<double>(got[i]) - want[i]) / (1 + std::fabs(want[i]));
    if (!(e <= worst)) {
      worst = std::isnan(e) ? INFINITY : e;
      at = i;
    }
  }
  EXPECT_LE(worst, bound) << what << ": worst at " << at << " got " << got[at]
                          << " want " << want[at];
}

TEST_P(VisionConformance, Rope2dMatchesOracle) {
  // Bound 1e-4 (1 + |want|): the backends form the angle pos * f_i in fp32 as the
  // reference's table does (relative 2^-24 of an angle up to 511 * 1 rad: ~3e-5
  // rad), the oracle in fp64; rotations themselves are 1e-7.
  for (int64_t hd : {48, 128}) {
    const int64_t heads = 3, tokens = 37, ld = heads * hd + 5;
    auto x = Normal(tokens * ld);
    std::vector<int32_t> pos(2 * tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      pos[2 * t] = static_cast<int32_t>((t * 37) % kMaxRopePosition);
      pos[2 * t + 1] = static_cast<int32_t>((t * 101 + 3) % kMaxRopePosition);
    }
    pos[0] = pos[1] = 0;
    pos[2] = pos[3] = kMaxRopePosition - 1;
    std::vector<float> want = x, got = x;
    ASSERT_TRUE(
        ref_->Rope2d(want.data(), ld, pos.data(), tokens, heads, hd, 10000.0f).ok());
    ASSERT_TRUE(
        be_->Rope2d(got.data(), ld, pos.data(), tokens, heads, hd, 10000.0f).ok());
    ExpectClose(got, want, 1e-4, "rope hd " + std::to_string(hd));
    // Token 0 sits at (0, 0): unchanged. Padding columns are never written.
    for (int64_t c = 0; c < ld; ++c) EXPECT_EQ(got[c], x[c]) << c;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = heads * hd; c < ld; ++c)
        EXPECT_EQ(got[t * ld + c], x[t * ld + c]);
    }
  }
}

TEST(VisionOracle, Rope2dRotatesColumnThenRowPairs) {
  // hd 8: f_0 = 1, f_1 = 10000^-0.5 = 0.01. Token at row 2, column 1.
  auto ref = CreateReferenceBackend();
  std::vector<float> x = {1, 0, 1, 0, 0, 1, 0, 1};
  const int32_t pos[2] = {2, 1};
  ASSERT_TRUE(ref->Rope2d(x.data(), 8, pos, 1, 1, 8, 10000.0f).ok());
  EXPECT_NEAR(x[0], std::cos(1.0), 1e-7);  // (1,0) by col * f_0 = 1
  EXPECT_NEAR(x[1], std::sin(1.0), 1e-7);
  EXPECT_NEAR(x[2], std::cos(2.0), 1e-7);  // (1,0) by row * f_0 = 2
  EXPECT_NEAR(x[3], std::sin(2.0), 1e-7);
  EXPECT_NEAR(x[4], -std::sin(0.01), 1e-7);  // (0,1) by col * f_1 = 0.01
  EXPECT_NEAR(x[5], std::cos(0.01), 1e-7);
  EXPECT_NEAR(x[6], -std::sin(0.02), 1e-7);  // (0,1) by row * f_1 = 0.02
  EXPECT_NEAR(x[7], std::cos(0.02), 1e-7);
}

TEST_P(VisionConformance, GeluMatchesOracle) {
  // Bound 1e-5 (1 + |want|): fp32 tanh / erf against fp64 (a few ulp).
  const int64_t rows = 9, n = 300, ld = 311;
  auto x = Normal(rows * ld, 3.0f);
  for (bool tanh_approx : {true, false}) {
    std::vector<float> want(rows * ld, 5.0f), got(rows * ld, 5.0f);
    ASSERT_TRUE(ref_->Gelu(x.data(), ld, want.data(), ld, rows, n, tanh_approx).ok());
    ASSERT_TRUE(be_->Gelu(x.data(), ld, got.data(), ld, rows, n, tanh_approx).ok());
    ExpectClose(got, want, 1e-5, tanh_approx ? "gelu tanh" : "gelu erf");
    // In place.
    std::vector<float> inplace = x;
    ASSERT_TRUE(
        be_->Gelu(inplace.data(), ld, inplace.data(), ld, rows, n, tanh_approx).ok());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(inplace[r * ld + i], got[r * ld + i]);
    }
  }
}

TEST(VisionOracle, GeluKnownValues) {
  auto ref = CreateReferenceBackend();
  const std::vector<float> x = {-3.0f, -1.0f, 0.0f, 1.0f, 2.0f};
  std::vector<float> erf(5), tanh(5);
  ASSERT_TRUE(ref->Gelu(x.data(), 5, erf.data(), 5, 1, 5, false).ok());
  ASSERT_TRUE(ref->Gelu(x.data(), 5, tanh.data(), 5, 1, 5, true).ok());
  // torch.nn.functional.gelu(x) and gelu(x, approximate="tanh").
  const float want_erf[] = {-0.0040496f, -0.1586553f, 0.0f, 0.8413447f, 1.9544997f};
  const float want_tanh[] = {-0.0036374f, -0.1588080f, 0.0f, 0.8411920f, 1.9545977f};
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(erf[i], want_erf[i], 2e-7) << i;
    EXPECT_NEAR(tanh[i], want_tanh[i], 2e-7) << i;
  }
}

TEST_P(VisionConformance, VisionAttentionAtK3HeadShapes) {
  // K3's tower: 12 heads of 128 (1536 / 12); and a head narrower than a warp's
  // columns (hd 20). Two images, the first over two key tiles and a partial
  // query tile. Bound as below.
  for (const auto& [heads, hd] : {std::pair<int64_t, int64_t>{12, 128}, {3, 20}}) {
    const int64_t width = heads * hd;
    const std::vector<int32_t> cu = {0, 45, 45 + 18};
    const int64_t T = cu.back(), ld = 3 * width;
    auto qkv = Normal(T * ld);
    VisionAttnArgs a;
    a.heads = heads;
    a.head_dim = hd;
    a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    a.num_images = 2;
    a.num_tokens = T;
    a.max_seqlen = 45;
    a.cu_seqlens = cu.data();
    a.q = qkv.data();
    a.k = qkv.data() + width;
    a.v = qkv.data() + 2 * width;
    a.ld_qkv = ld;
    a.ld_out = width;
    std::vector<float> want(T * width), got(T * width, 7.0f);
    a.out = want.data();
    ASSERT_TRUE(ref_->VisionAttention(a).ok());
    a.out = got.data();
    ASSERT_TRUE(be_->VisionAttention(a).ok());
    double mx = 0, worst = 0;
    for (float w : want) mx = std::max(mx, std::fabs(static_cast<double>(w)));
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::fabs(got[i] - want[i]) / mx);
    EXPECT_LE(worst, AttentionBound()) << heads << " heads of " << hd;
  }
}

TEST_P(VisionConformance, VisionAttentionMatchesOracleAndStaysInsideEachImage) {
  // Bound AttentionBound() * max|want| (norm-wise, as MLA in conformance_test.cc):
  // fp32 GEMM products and an fp32 softmax against fp64.
  const int64_t heads = 2, hd = 48, width = heads * hd;
  const std::vector<int32_t> cu = {0, 5, 5 + 71, 5 + 71 + 1, 5 + 71 + 1 + 130};
  const int64_t T = cu.back(), ld = 3 * width + 4, ldo = width + 3;
  auto qkv = Normal(T * ld);
  VisionAttnArgs a;
  a.heads = heads;
  a.head_dim = hd;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  a.num_images = 4;
  a.num_tokens = T;
  a.max_seqlen = 130;
  a.cu_seqlens = cu.data();
  a.q = qkv.data();
  a.k = qkv.data() + width;
  a.v = qkv.data() + 2 * width;
  a.ld_qkv = ld;
  a.ld_out = ldo;
  std::vector<float> want(T * ldo, 9.0f), got(T * ldo, 9.0f);
  a.out = want.data();
  ASSERT_TRUE(ref_->VisionAttention(a).ok());
  a.out = got.data();
  ASSERT_TRUE(be_->VisionAttention(a).ok());
  double mx = 0;
  for (float w : want) mx = std::max(mx, std::fabs(static_cast<double>(w)));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - want[i]) / mx);
  EXPECT_LE(worst, AttentionBound());
  // A one-token image attends only to itself: out = v, up to how the backend
  // carries v: the GPU's tensor-core kernel as split-BF16 hi + lo, whose lo is
  // rounded to BF16 (at most 2^-16 of |v|), or rounded to BF16 (2^-9); fp32
  // elsewhere.
  const double v_rel = GpuBf16Operands(GetParam()) ? 4e-3 : 1.6e-5;
  for (int64_t c = 0; c < width; ++c) {
    const float v = qkv[76 * ld + 2 * width + c];
    EXPECT_NEAR(got[76 * ldo + c], v, v_rel * std::fabs(v) + 1e-7);
  }
  // Changing image 1's keys and values changes no other image's rows.
  std::vector<float> qkv2 = qkv;
  for (int64_t t = cu[1]; t < cu[2]; ++t) {
    for (int64_t c = width; c < 3 * width; ++c) qkv2[t * ld + c] += 0.5f;
  }
  std::vector<float> got2(T * ldo, 9.0f);
  a.q = qkv2.data();
  a.k = qkv2.data() + width;
  a.v = qkv2.data() + 2 * width;
  a.out = got2.data();
  ASSERT_TRUE(be_->VisionAttention(a).ok());
  for (int64_t t = 0; t < T; ++t) {
    const bool inside = t >= cu[1] && t < cu[2];
    bool same = true;
    for (int64_t c = 0; c < width; ++c) same &= got2[t * ldo + c] == got[t * ldo + c];
    EXPECT_EQ(same, !inside) << "token " << t;
  }
}

TEST_P(VisionConformance, Merge2x2MatchesOracleExactly) {
  const int64_t gh = 6, gw = 8, d = 5, ldx = 7, ldo = 4 * d + 2;
  auto x = Normal(gh * gw * ldx);
  std::vector<float> want(gh * gw / 4 * ldo, 3.0f), got = want;
  ASSERT_TRUE(ref_->Merge2x2(x.data(), ldx, gh, gw, d, want.data(), ldo).ok());
  ASSERT_TRUE(be_->Merge2x2(x.data(), ldx, gh, gw, d, got.data(), ldo).ok());
  EXPECT_EQ(got, want);
  // Merged token m = 1 * (8/2) + 2 = 6 holds patches (2,4), (2,5), (3,4), (3,5).
  const int64_t src[4] = {2 * gw + 4, 2 * gw + 5, 3 * gw + 4, 3 * gw + 5};
  for (int part = 0; part < 4; ++part) {
    for (int64_t c = 0; c < d; ++c) {
      EXPECT_EQ(got[6 * ldo + part * d + c], x[src[part] * ldx + c]);
    }
  }
}

TEST_P(VisionConformance, BadInputsAreInvalidArgument) {
  std::vector<float> x(4096, 1.0f), out(4096);
  std::vector<int32_t> pos = {0, 0, 512, 3};
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(be_->Rope2d(x.data(), 8, pos.data(), 2, 1, 8, 10000.0f).code(), kInvalid);
  EXPECT_EQ(be_->Rope2d(x.data(), 6, pos.data(), 1, 1, 6, 10000.0f).code(), kInvalid);
  EXPECT_EQ(be_->Merge2x2(x.data(), 4, 3, 4, 4, out.data(), 16).code(), kInvalid);
  EXPECT_EQ(be_->Merge2x2(x.data(), 4, 2, 4, 4, out.data(), 15).code(), kInvalid);
  EXPECT_EQ(be_->Gelu(x.data(), 3, out.data(), 4, 2, 4, true).code(), kInvalid);
  const std::vector<int32_t> cu = {0, 3, 2};
  VisionAttnArgs a;
  a.heads = 1;
  a.head_dim = 4;
  a.scale = 0.5f;
  a.num_images = 2;
  a.num_tokens = 2;
  a.max_seqlen = 3;
  a.cu_seqlens = cu.data();
  a.q = a.k = a.v = x.data();
  a.ld_qkv = 12;
  a.out = out.data();
  a.ld_out = 4;
  EXPECT_EQ(be_->VisionAttention(a).code(), kInvalid);  // image 1 has -1 tokens
  // Empty inputs are no-ops.
  std::vector<float> keep = out;
  EXPECT_TRUE(be_->Rope2d(x.data(), 8, pos.data(), 0, 1, 8, 10000.0f).ok());
  EXPECT_TRUE(be_->Gelu(x.data(), 4, out.data(), 4, 0, 4, true).ok());
  EXPECT_TRUE(be_->Merge2x2(x.data(), 4, 0, 0, 4, out.data(), 16).ok());
  a.num_images = 0;
  EXPECT_TRUE(be_->VisionAttention(a).ok());
  EXPECT_EQ(out, keep);
}

// On a device backend the position and cu_seqlens tables are device memory: the
// kernels check them, and Synchronize() reports a bad entry by name (the
// staging adapter's host checks off, so the table reaches the device as is).
TEST(VisionOps, GpuKernelsReportBadTablesThroughTheErrorWord) {
  // The emulator in the default build; the GPU in a --config=cuda build.
  auto device = cuda::CreateCudaSimBackend();
  if (!device.ok()) device = cuda::CreateCudaBackend();
  if (!device.ok()) GTEST_SKIP() << "no GPU backend here: " << device.status();
  StagingBackend::Options o;
  o.check_contents = false;
  StagingBackend be(std::move(device).value(), o);
  std::vector<float> x(64, 1.0f), out(64, 0.0f);
  const std::vector<int32_t> pos = {0, 0, 3, kMaxRopePosition};
  absl::Status st = be.Rope2d(x.data(), 8, pos.data(), 2, 1, 8, 10000.0f);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "rotary position out of range")) << st;
  // The next op runs clean: the error word was cleared.
  const std::vector<int32_t> good = {0, 0, 3, 4};
  EXPECT_TRUE(be.Rope2d(x.data(), 8, good.data(), 2, 1, 8, 10000.0f).ok());

  const std::vector<int32_t> cu = {0, 3, 2};  // image 1 has -1 tokens
  VisionAttnArgs a;
  a.heads = 1;
  a.head_dim = 4;
  a.scale = 0.5f;
  a.num_images = 2;
  a.num_tokens = 2;
  a.max_seqlen = 3;
  a.cu_seqlens = cu.data();
  a.q = a.k = a.v = x.data();
  a.ld_qkv = 12;
  a.out = out.data();
  a.ld_out = 4;
  st = be.VisionAttention(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "cu_seqlens")) << st;
  // A head wider than the kernel takes is refused by name, before any launch.
  a.head_dim = 256;
  a.ld_qkv = 3 * 256;
  a.ld_out = 256;
  const std::vector<int32_t> one = {0, 1};
  a.cu_seqlens = one.data();
  a.num_images = 1;
  a.num_tokens = 1;
  a.max_seqlen = 1;
  std::vector<float> wide(3 * 256, 0.5f), wide_out(256);
  a.q = wide.data();
  a.k = wide.data() + 256;
  a.v = wide.data() + 512;
  a.out = wide_out.data();
  st = be.VisionAttention(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "head_dim 256")) << st;
}

// Every backend here implements the four ops (the GPU backends as kernels): the
// tower loads wherever the text model runs. A backend that lacked one would have
// to answer Supports() = false and Unimplemented naming the op (Backend's
// defaults), which VisionTower::Create turns into a load error.
TEST(VisionOps, EveryBackendImplementsTheVisionOps) {
  for (const std::string& name : ConformanceBackendNames()) {
    std::unique_ptr<Backend> be = MakeConformanceBackend(name);
    ASSERT_NE(be, nullptr) << name;
    for (Op op : kVisionOps) EXPECT_TRUE(be->Supports(op)) << name << " " << OpName(op);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, VisionConformance,
                         ::testing::ValuesIn(ConformanceBackendNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::kernels
