// The vision-tower kernels (vision.cu) on the SIMT emulator against the fp64
// oracle (CreateReferenceBackend), their launchers on host vectors (the
// emulator's device memory is host memory). Exact-size vectors, so that under
// ASan (./tandem test's emulator run) any access past an argument is caught;
// strided rows carry guard values that must stay untouched. Every test runs
// under several emulator seeds (thread and block order shuffled).
//
// Bounds (the conformance suite's): 1e-4 (1 + |want|) for RoPE (fp32 angles),
// 1e-5 (1 + |want|) for GELU, 2e-5 of max|want| for attention, exact for the
// merge.
#include "kernels/cuda/vision.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

constexpr float kGuard = 12345.0f;

class Vision : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    saved_seed_ = cuda_sim::Seed();
    cuda_sim::SetSeed(GetParam());
    rng_.seed(2000 + static_cast<uint32_t>(GetParam()));
    ref_ = CreateReferenceBackend();
  }
  void TearDown() override { cuda_sim::SetSeed(saved_seed_); }
  std::vector<float> Normal(int64_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  uint64_t saved_seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<Backend> ref_;
};

// The CPU backends' frequencies (fp32 pow), as GpuBackend passes them.
std::vector<float> Freqs(int64_t hd, float theta) {
  std::vector<float> f(hd / 4);
  for (int64_t i = 0; i < hd / 4; ++i) {
    f[i] = 1.0f / std::pow(theta, static_cast<float>(4 * i) / static_cast<float>(hd));
  }
  return f;
}

TEST_P(Vision, Rope2dMatchesTheOracleAndLeavesPaddingAlone) {
  const int64_t heads = 2, hd = 128, tokens = 19, width = heads * hd, ld = width + 3;
  std::vector<float> x = Normal(tokens * ld);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = width; c < ld; ++c) x[t * ld + c] = kGuard;
  std::vector<int32_t> pos(2 * tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    pos[2 * t] = static_cast<int32_t>((t * 53) % kMaxRopePosition);
    pos[2 * t + 1] = static_cast<int32_t>((t * 7 + 500) % kMaxRopePosition);
  }
  std::vector<float> want = x, got = x;
  ASSERT_TRUE(
      ref_->Rope2d(want.data(), ld, pos.data(), tokens, heads, hd, 10000.0f).ok());
  const std::vector<float> f = Freqs(hd, 10000.0f);
  int32_t err = kDeviceOk;
  ASSERT_EQ(LaunchRope2d(got.data(), ld, pos.data(), tokens, heads, hd, f.data(),
                         kMaxRopePosition, &err, nullptr),
            nullptr);
  EXPECT_EQ(err, kDeviceOk);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - want[i]), 1e-4 * (1 + std::fabs(want[i]))) << i;
  }
  // A position outside the table: recorded, and that token left as it was.
  pos[2 * 3 + 1] = kMaxRopePosition;
  std::vector<float> bad = x;
  ASSERT_EQ(LaunchRope2d(bad.data(), ld, pos.data(), tokens, heads, hd, f.data(),
                         kMaxRopePosition, &err, nullptr),
            nullptr);
  EXPECT_EQ(err, kPositionOutOfRange);
  for (int64_t c = 0; c < ld; ++c) EXPECT_EQ(bad[3 * ld + c], x[3 * ld + c]) << c;
}

TEST_P(Vision, GeluBothFormsMatchTheOracle) {
  const int64_t rows = 5, n = 77, ld = 80;
  const std::vector<float> x = Normal(rows * ld, 3.0f);
  for (bool tanh_approx : {true, false}) {
    std::vector<float> want(rows * ld, kGuard), got(rows * ld, kGuard);
    ASSERT_TRUE(ref_->Gelu(x.data(), ld, want.data(), ld, rows, n, tanh_approx).ok());
    ASSERT_EQ(LaunchGelu(x.data(), ld, got.data(), ld, rows, n, tanh_approx, nullptr),
              nullptr);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_LE(std::fabs(got[i] - want[i]), 1e-5 * (1 + std::fabs(want[i])))
          << i << (tanh_approx ? " tanh" : " erf");
    }
  }
}

// Both attention kernels against the oracle. Four images: 1 token, 33, 20 and
// 150 (the tensor-core kernel: three 64-query tiles, the last partial, five key
// tiles, the last partial; the SIMT kernel: ten 16-query tiles); K3's head_dim
// 128, 48 (the tiny tower's) on both kernels, a narrow 24 on the SIMT one.
TEST_P(Vision, AttentionMatchesTheOracleWithinEachImage) {
  // Bounds (max error over max |want|): 2e-5 for the exact kernels; the
  // BF16-operand kernel ("cuda_bf16") 2e-2 (q, k, v and p rounded to BF16:
  // 2^-9 relative each).
  struct Case {
    int64_t hd;
    VisionAttnCore core;
    bool bf16 = false;
  };
  for (const Case& c :
       {Case{128, VisionAttnCore::kTensorCore}, Case{128, VisionAttnCore::kSimt},
        Case{48, VisionAttnCore::kTensorCore}, Case{48, VisionAttnCore::kSimt},
        Case{24, VisionAttnCore::kAuto}, Case{128, VisionAttnCore::kTensorCore, true},
        Case{48, VisionAttnCore::kAuto, true}}) {
    const int64_t hd = c.hd;
    const std::string what =
        absl::StrCat("hd ", hd,
                     c.core == VisionAttnCore::kTensorCore ? " tensor cores"
                     : c.core == VisionAttnCore::kSimt     ? " simt"
                                                           : " auto",
                     c.bf16 ? " bf16" : "");
    // An even row stride at hd 128 (the tensor-core kernel's 8-byte loads), odd
    // at the others (its element loads).
    const int64_t heads = 3, width = heads * hd, ld = 3 * width + (hd == 128 ? 0 : 1),
                  ldo = width + 2;
    const std::vector<int32_t> cu = {0, 1, 34, 54, 204};
    const int64_t T = cu.back(), max_seqlen = 150;
    const std::vector<float> qkv = Normal(T * ld);
    std::vector<float> want(T * ldo, kGuard), got(T * ldo, kGuard);
    VisionAttnArgs a;
    a.heads = heads;
    a.head_dim = hd;
    a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    a.num_images = 4;
    a.num_tokens = T;
    a.max_seqlen = max_seqlen;
    a.cu_seqlens = cu.data();
    a.q = qkv.data();
    a.k = qkv.data() + width;
    a.v = qkv.data() + 2 * width;
    a.ld_qkv = ld;
    a.out = want.data();
    a.ld_out = ldo;
    ASSERT_TRUE(ref_->VisionAttention(a).ok());
    int32_t err = kDeviceOk;
    ASSERT_EQ(LaunchVisionAttention(a.q, a.k, a.v, ld, got.data(), ldo, cu.data(), 4, T,
                                    max_seqlen, heads, hd, a.scale, &err, nullptr,
                                    c.core, c.bf16),
              nullptr)
        << what;
    EXPECT_EQ(err, kDeviceOk) << what;
    double mx = 0, worst = 0;
    for (float w : want)
      if (w != kGuard) mx = std::max(mx, std::fabs(static_cast<double>(w)));
    for (size_t i = 0; i < got.size(); ++i) {
      if (want[i] == kGuard) {
        ASSERT_EQ(got[i], kGuard) << what << ": padding " << i << " written";
        continue;
      }
      worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]) / mx);
    }
    EXPECT_LE(worst, c.bf16 ? 2e-2 : 2e-5) << what;
    // The BF16 kernel is the one that ran: its error is BF16's, not fp32's.
    if (c.bf16) {
      EXPECT_GE(worst, 1e-4) << what;
    }
  }
  // The tensor-core kernel takes whole k-steps of 16 only.
  std::vector<float> x(3 * 24), out(24);
  const std::vector<int32_t> cu = {0, 1};
  int32_t err = kDeviceOk;
  const char* e = LaunchVisionAttention(x.data(), x.data() + 24, x.data() + 48, 72,
                                        out.data(), 24, cu.data(), 1, 1, 1, 1, 24, 1.0f,
                                        &err, nullptr, VisionAttnCore::kTensorCore);
  ASSERT_NE(e, nullptr);
  EXPECT_THAT(std::string(e), ::testing::HasSubstr("head_dim % 16"));
}

TEST_P(Vision, AttentionRecordsABadImageTable) {
  const int64_t hd = 8, T = 6;
  const std::vector<float> qkv = Normal(T * 3 * hd);
  std::vector<float> out(T * hd, kGuard);
  // Not ending at num_tokens; then an image longer than max_seqlen.
  for (const std::vector<int32_t>& cu :
       {std::vector<int32_t>{0, 2, 5}, std::vector<int32_t>{0, 1, 6}}) {
    int32_t err = kDeviceOk;
    ASSERT_EQ(LaunchVisionAttention(qkv.data(), qkv.data() + hd, qkv.data() + 2 * hd,
                                    3 * hd, out.data(), hd, cu.data(), 2, T, 4, 1, hd,
                                    0.5f, &err, nullptr),
              nullptr);
    EXPECT_EQ(err, kBadImageTable) << cu[1];
  }
  // Nothing was written for the image with the bad entry (the last one: its
  // end) nor for the one beyond max_seqlen.
  for (int64_t i = 2 * hd; i < T * hd; ++i) EXPECT_EQ(out[i], kGuard) << i;
}

TEST_P(Vision, Merge2x2IsTheOraclesPermutation) {
  const int64_t gh = 4, gw = 6, d = 5, ldx = 6, ldo = 4 * d + 1;
  const std::vector<float> x = Normal(gh * gw * ldx);
  std::vector<float> want(gh * gw / 4 * ldo, kGuard), got = want;
  ASSERT_TRUE(ref_->Merge2x2(x.data(), ldx, gh, gw, d, want.data(), ldo).ok());
  ASSERT_EQ(LaunchMerge2x2(x.data(), ldx, gh, gw, d, got.data(), ldo, nullptr),
            nullptr);
  EXPECT_EQ(got, want);
}

INSTANTIATE_TEST_SUITE_P(Seeds, Vision, ::testing::Values(0, 1, 2, 77),
                         [](const auto& info) {
                           return "seed" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace tandem::kernels::cuda
