// The elementwise-family kernels (elementwise.cu) on the SIMT emulator against the
// fp64 oracle (CreateReferenceBackend). Under the emulator device memory is host
// memory, so the launchers run on host vectors (index arrays and AttnResMix's
// pointer bank included).
//
// Bounds (the conformance suite's): |got - want| <= 1e-5 * (1 + |want|) per element
// for the fp32 ops; exact for AddInPlace, copies (embedding, conv state) and BF16
// bits. Every test runs under several emulator seeds (thread and block order
// shuffled), and strided rows carry guard values that must stay untouched.
#include "kernels/cuda/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

constexpr float kGuard = 12345.0f;  // padding of strided rows: must stay untouched

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 double bound, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) /
                     (1.0 + std::fabs(static_cast<double>(want[i])));
    if (!(e <= worst)) {  // NaN-safe
      worst = std::isnan(e) ? INFINITY : e;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, bound) << what << ": worst at " << worst_i << " got " << got[worst_i]
                          << " want " << want[worst_i];
}

class Elementwise : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    saved_seed_ = cuda_sim::Seed();
    cuda_sim::SetSeed(GetParam());
    rng_.seed(1000 + static_cast<uint32_t>(GetParam()));
    ref_ = CreateReferenceBackend();
  }
  void TearDown() override { cuda_sim::SetSeed(saved_seed_); }

  std::vector<float> Normal(int64_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  // [rows, ld] with the columns past n set to kGuard.
  std::vector<float> Strided(int64_t rows, int64_t n, int64_t ld, float sd = 1.0f) {
    std::vector<float> v = Normal(rows * ld, sd);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = n; i < ld; ++i) v[r * ld + i] = kGuard;
    }
    return v;
  }
  std::vector<float> Guards(int64_t size) { return std::vector<float>(size, kGuard); }

  std::mt19937 rng_;
  std::unique_ptr<Backend> ref_;
  uint64_t saved_seed_ = 0;
};

// ---- Norms
// ----------------------------------------------------------------------------

TEST_P(Elementwise, RmsNormMatchesTheOracle) {
  struct Shape {
    int64_t rows, n, ld;
  };
  // Warp path (n <= 1024) and block path, float4 (n, ld % 4 == 0) and scalar, one row,
  // odd widths, strides > n, the K3 widths (7168 hidden, 1536 q_lora, 512 kv_lora with
  // ld 576).
  for (const Shape s :
       {Shape{1, 1, 1}, Shape{5, 17, 20}, Shape{5, 128, 131}, Shape{3, 128, 128},
        Shape{2, 512, 576}, Shape{3, 1030, 1030}, Shape{2, 1028, 1032},
        Shape{2, 1536, 1539}, Shape{2, 7168, 7168}, Shape{1, 7168, 7171}}) {
    for (float eps : {1e-5f, 1e-6f}) {
      const std::string what = "rmsnorm rows " + std::to_string(s.rows) + " n " +
                               std::to_string(s.n) + " ld " + std::to_string(s.ld);
      auto x = Strided(s.rows, s.n, s.ld, 2.0f), w = Normal(s.n);
      auto want = Guards(s.rows * s.ld), got = want;
      ASSERT_TRUE(
          ref_->RmsNorm(x.data(), s.ld, w.data(), want.data(), s.ld, s.rows, s.n, eps)
              .ok());
      ASSERT_EQ(LaunchRmsNorm(x.data(), s.ld, w.data(), got.data(), s.ld, s.rows, s.n,
                              eps, nullptr),
                nullptr)
          << what;
      ExpectClose(got, want, 1e-5, what);
      // In place (y == x).
      auto inplace = x;
      ASSERT_EQ(LaunchRmsNorm(inplace.data(), s.ld, w.data(), inplace.data(), s.ld,
                              s.rows, s.n, eps, nullptr),
                nullptr);
      for (int64_t r = 0; r < s.rows; ++r) {  // the padding keeps x's guards
        for (int64_t i = s.n; i < s.ld; ++i) want[r * s.ld + i] = kGuard;
      }
      ExpectClose(inplace, want, 1e-5, what + " in place");
    }
  }
  {  // Per-head (KDA o_norm shape): rows = tokens * heads, n = head_dim, in place.
    auto x = Normal(3 * 96 * 128), w = Normal(128);
    std::vector<float> want(x.size()), got = x;
    ASSERT_TRUE(
        ref_->RmsNorm(x.data(), 128, w.data(), want.data(), 128, 3 * 96, 128, 1e-5f)
            .ok());
    ASSERT_EQ(LaunchRmsNorm(got.data(), 128, w.data(), got.data(), 128, 3 * 96, 128,
                            1e-5f, nullptr),
              nullptr);
    ExpectClose(got, want, 1e-5, "rmsnorm per head in place");
  }
  {  // Misaligned pointers take the scalar path.
    const int64_t rows = 2, n = 256;
    auto x = Normal(rows * n + 1), w = Normal(n + 1);
    std::vector<float> want(rows * n), got(rows * n + 1, kGuard);
    ASSERT_TRUE(
        ref_->RmsNorm(x.data() + 1, n, w.data() + 1, want.data(), n, rows, n, 1e-6f)
            .ok());
    ASSERT_EQ(LaunchRmsNorm(x.data() + 1, n, w.data() + 1, got.data() + 1, n, rows, n,
                            1e-6f, nullptr),
              nullptr);
    EXPECT_EQ(got[0], kGuard);
    ExpectClose(std::vector<float>(got.begin() + 1, got.end()), want, 1e-5,
                "rmsnorm misaligned");
  }
  // Nothing to do: no launch, no error.
  EXPECT_EQ(LaunchRmsNorm(nullptr, 0, nullptr, nullptr, 0, 0, 16, 1e-5f, nullptr),
            nullptr);
}

TEST_P(Elementwise, L2NormHeadsMatchesTheOracle) {
  struct Shape {
    int64_t rows, heads, d, ld;
  };
  for (const Shape s : {Shape{4, 5, 24, 5 * 24 + 7}, Shape{1, 1, 7, 7},
                        Shape{3, 96, 128, 96 * 128},  // K3 q/k heads
                        Shape{2, 2, 2048, 4100}}) {   // block path
    const int64_t width = s.heads * s.d;
    const std::string what = "l2norm heads " + std::to_string(s.heads) + " d " +
                             std::to_string(s.d) + " ld " + std::to_string(s.ld);
    for (float scale : {1.0f, 1.0f / std::sqrt(static_cast<float>(s.d))}) {
      auto x = Strided(s.rows, width, s.ld);
      auto want = Guards(s.rows * s.ld), got = want;
      ASSERT_TRUE(ref_->L2NormHeads(x.data(), s.ld, want.data(), s.ld, s.rows, s.heads,
                                    s.d, 1e-6f, scale)
                      .ok());
      ASSERT_EQ(LaunchL2NormHeads(x.data(), s.ld, got.data(), s.ld, s.rows, s.heads,
                                  s.d, 1e-6f, scale, nullptr),
                nullptr);
      ExpectClose(got, want, 1e-5, what);
      double ss = 0;
      for (int64_t i = 0; i < s.d; ++i) ss += static_cast<double>(got[i]) * got[i];
      EXPECT_NEAR(ss, scale * scale, 1e-5) << what;
      auto inplace = x;  // y == x
      ASSERT_EQ(LaunchL2NormHeads(inplace.data(), s.ld, inplace.data(), s.ld, s.rows,
                                  s.heads, s.d, 1e-6f, scale, nullptr),
                nullptr);
      ExpectClose(inplace, want, 1e-5, what + " in place");
    }
  }
}

TEST_P(Elementwise, KdaOutputGateMatchesTheOracle) {
  struct Shape {
    int64_t tokens, heads, d, pad;
  };
  for (const Shape s :
       {Shape{5, 3, 16, 0}, Shape{3, 3, 13, 5}, Shape{2, 96, 128, 0},  // K3 at decode
        Shape{1, 96, 128, 4}}) {
    const int64_t width = s.heads * s.d, ld = width + s.pad;
    const std::string what = "kda output gate heads " + std::to_string(s.heads) +
                             " d " + std::to_string(s.d) + " ld " + std::to_string(ld);
    auto o = Strided(s.tokens, width, ld), gate = Strided(s.tokens, width, ld, 2.0f);
    auto nw = Normal(s.d);
    auto want = Guards(s.tokens * ld), got = o;
    ASSERT_TRUE(ref_->KdaOutputGate(o.data(), ld, nw.data(), gate.data(), ld,
                                    want.data(), ld, s.tokens, s.heads, s.d, 1e-5f)
                    .ok());
    // In place (out == o), the engine's use.
    ASSERT_EQ(
        LaunchKdaOutputGate(got.data(), ld, nw.data(), gate.data(), ld, got.data(), ld,
                            s.tokens, s.heads, s.d, 1e-5f, nullptr),
        nullptr);
    ExpectClose(got, want, 1e-5, what);
  }
}

TEST_P(Elementwise, FusedAddRmsNormWritesTheSumAndItsNorm) {
  struct Shape {
    int64_t rows, n, ld;
  };
  for (const Shape s : {Shape{1, 7168, 7168}, Shape{3, 7168, 7172}, Shape{2, 100, 103},
                        Shape{4, 64, 64}}) {
    const std::string what = "add+rmsnorm n " + std::to_string(s.n);
    auto x = Strided(s.rows, s.n, s.ld), res = Strided(s.rows, s.n, s.ld);
    auto w = Normal(s.n);
    auto sum = x;
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t i = 0; i < s.n; ++i) sum[r * s.ld + i] += res[r * s.ld + i];
    }
    auto want = Guards(s.rows * s.ld), got = want;
    ASSERT_TRUE(
        ref_->RmsNorm(sum.data(), s.ld, w.data(), want.data(), s.ld, s.rows, s.n, 1e-6f)
            .ok());
    ASSERT_EQ(LaunchAddRmsNorm(x.data(), s.ld, res.data(), s.ld, w.data(), got.data(),
                               s.ld, s.rows, s.n, 1e-6f, nullptr),
              nullptr);
    EXPECT_EQ(x, sum) << what << ": x must hold x + res exactly";
    ExpectClose(got, want, 1e-5, what);
  }
}

// ---- Binary element-wise
// ----------------------------------------------------------------

TEST_P(Elementwise, SituGluAndMulSigmoidMatchTheOracle) {
  struct Shape {
    int64_t rows, n, ld;
  };
  for (const Shape s : {Shape{3, 257, 257}, Shape{2, 1024, 1028}, Shape{1, 3, 3},
                        Shape{2, 3072, 3072}}) {
    const std::string what = " rows " + std::to_string(s.rows) + " n " +
                             std::to_string(s.n) + " ld " + std::to_string(s.ld);
    // A wide range: tanh saturates on both sides.
    auto g = Strided(s.rows, s.n, s.ld, 20.0f), u = Strided(s.rows, s.n, s.ld, 60.0f);
    auto want = Guards(s.rows * s.ld), got = want;
    ASSERT_TRUE(ref_->SituGlu(g.data(), s.ld, u.data(), s.ld, want.data(), s.ld, s.rows,
                              s.n, 4.0f, 25.0f)
                    .ok());
    ASSERT_EQ(LaunchSituGlu(g.data(), s.ld, u.data(), s.ld, got.data(), s.ld, s.rows,
                            s.n, 4.0f, 25.0f, nullptr),
              nullptr);
    ExpectClose(got, want, 1e-5, "situ" + what);
    ASSERT_TRUE(
        ref_->MulSigmoid(g.data(), s.ld, u.data(), s.ld, want.data(), s.ld, s.rows, s.n)
            .ok());
    got = g;  // in place: out == x
    ASSERT_EQ(LaunchMulSigmoid(got.data(), s.ld, u.data(), s.ld, got.data(), s.ld,
                               s.rows, s.n, nullptr),
              nullptr);
    ExpectClose(got, want, 1e-5, "mul_sigmoid in place" + what);
  }
  // Known values: g = 0 -> 0; large g, u -> beta * lbeta.
  float g1[2] = {0.0f, 100.0f}, u1[2] = {3.0f, 1000.0f}, o1[2];
  ASSERT_EQ(LaunchSituGlu(g1, 2, u1, 2, o1, 2, 1, 2, 4.0f, 25.0f, nullptr), nullptr);
  EXPECT_EQ(o1[0], 0.0f);
  EXPECT_NEAR(o1[1], 100.0f, 1e-3f);
}

// 65535 is the largest grid y: the row-grid kernels loop over the rest. One seed
// only (65535 blocks are slow to emulate, ~40 s under ASan).
TEST(ElementwiseGrid, RowsBeyondTheGridLimitLoop) {
  const uint64_t saved = cuda_sim::Seed();
  cuda_sim::SetSeed(3);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 65535 + 70, n = 4;
  std::vector<float> x(rows * n), gate(rows * n);
  for (float& v : x) v = nd(rng);
  for (float& v : gate) v = nd(rng);
  std::vector<float> want(rows * n), got(rows * n, kGuard);
  ASSERT_TRUE(CreateReferenceBackend()
                  ->MulSigmoid(x.data(), n, gate.data(), n, want.data(), n, rows, n)
                  .ok());
  ASSERT_EQ(
      LaunchMulSigmoid(x.data(), n, gate.data(), n, got.data(), n, rows, n, nullptr),
      nullptr);
  ExpectClose(got, want, 1e-5, "mul_sigmoid rows past the grid");
  cuda_sim::SetSeed(saved);
}

TEST_P(Elementwise, AddInPlaceIsExact) {
  for (int64_t n : {1, 3, 4, 1027, 7168 * 2}) {
    for (int64_t offset : {0, 1}) {  // aligned (float4 + tail) and misaligned
      auto x = Normal(n + offset), y = Normal(n + offset);
      auto want = y;
      ASSERT_TRUE(ref_->AddInPlace(want.data() + offset, x.data() + offset, n).ok());
      ASSERT_EQ(LaunchAddInPlace(y.data() + offset, x.data() + offset, n, nullptr),
                nullptr);
      EXPECT_EQ(y, want) << "n " << n << " offset " << offset;
    }
  }
}

TEST_P(Elementwise, KdaGatesMatchTheOracle) {
  struct Shape {
    int64_t tokens, heads, d, pad_g, pad_b;
  };
  for (const Shape s : {Shape{5, 3, 16, 0, 0}, Shape{4, 3, 7, 5, 2},
                        Shape{2, 96, 128, 0, 0}}) {  // K3 at decode
    const int64_t width = s.heads * s.d, ld_g = width + s.pad_g,
                  ld_b = s.heads + s.pad_b;
    auto graw = Strided(s.tokens, width, ld_g, 3.0f), a_log = Normal(s.heads, 0.5f),
         dt = Normal(width), braw = Strided(s.tokens, s.heads, ld_b, 2.0f);
    std::vector<float> g0(s.tokens * width), b0(s.tokens * s.heads);
    auto g1 = Guards(g0.size()), b1 = Guards(b0.size());
    ASSERT_TRUE(ref_->KdaGates(graw.data(), ld_g, a_log.data(), dt.data(), braw.data(),
                               ld_b, -5.0f, s.tokens, s.heads, s.d, g0.data(),
                               b0.data())
                    .ok());
    ASSERT_EQ(
        LaunchKdaGates(graw.data(), ld_g, a_log.data(), dt.data(), braw.data(), ld_b,
                       -5.0f, s.tokens, s.heads, s.d, g1.data(), b1.data(), nullptr),
        nullptr);
    const std::string what = "kda gates heads " + std::to_string(s.heads);
    ExpectClose(g1, g0, 1e-5, what + " g");
    ExpectClose(b1, b0, 1e-5, what + " beta");
    for (float v : g1) ASSERT_TRUE(v <= 0.0f && v >= -5.0f) << v;
  }
}

// ---- Index-checked copies
// --------------------------------------------------------------

TEST_P(Elementwise, EmbeddingGatherCopiesRowsAndFlagsBadIds) {
  for (int64_t hidden : {37, 64, 7168}) {  // scalar, float4, K3 hidden
    const int64_t vocab = 50;
    std::vector<uint16_t> table(vocab * hidden);
    for (size_t i = 0; i < table.size(); ++i) {
      table[i] = F32ToBf16(std::normal_distribution<float>(0.0f, 1.0f)(rng_));
    }
    std::vector<int32_t> ids = {0, 49, 7, 7, 13};
    std::vector<float> got(ids.size() * hidden, kGuard), want(got.size());
    int32_t err = 0;
    ASSERT_TRUE(ref_->EmbeddingGather(table.data(), vocab, hidden, ids.data(),
                                      ids.size(), want.data())
                    .ok());
    ASSERT_EQ(LaunchEmbeddingGather(table.data(), vocab, 0, vocab, hidden, ids.data(),
                                    ids.size(), got.data(), &err, nullptr),
              nullptr);
    EXPECT_EQ(err, kDeviceOk);
    EXPECT_EQ(got, want) << "hidden " << hidden;
    // A bad id: recorded, its row zeroed, the others still gathered.
    for (int32_t bad : {-1, 50, std::numeric_limits<int32_t>::max()}) {
      std::vector<int32_t> ids2 = {3, bad, 9};
      std::vector<float> out(3 * hidden, kGuard);
      err = 0;
      ASSERT_EQ(LaunchEmbeddingGather(table.data(), vocab, 0, vocab, hidden,
                                      ids2.data(), 3, out.data(), &err, nullptr),
                nullptr);
      EXPECT_EQ(err, kTokenIdOutOfRange) << bad;
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(out[i], Bf16ToF32(table[3 * hidden + i]));
        ASSERT_EQ(out[hidden + i], 0.0f);
        ASSERT_EQ(out[2 * hidden + i], Bf16ToF32(table[9 * hidden + i]));
      }
    }
    // The first error wins: an earlier code is kept.
    err = kSlotOutOfRange;
    std::vector<int32_t> bad = {-5};
    ASSERT_EQ(LaunchEmbeddingGather(table.data(), vocab, 0, vocab, hidden, bad.data(),
                                    1, got.data(), &err, nullptr),
              nullptr);
    EXPECT_EQ(err, kSlotOutOfRange);
    // Vocabulary parallelism: a table of rows [20, 30); ids elsewhere in the
    // vocabulary give zero rows without an error, ids outside it record one.
    const int64_t first = 20, rows = 10;
    std::vector<int32_t> mixed = {20, 3, 29, 30, 25, 49};
    std::vector<float> out(mixed.size() * hidden, kGuard);
    err = 0;
    ASSERT_EQ(
        LaunchEmbeddingGather(table.data() + first * hidden, vocab, first, rows, hidden,
                              mixed.data(), mixed.size(), out.data(), &err, nullptr),
        nullptr);
    EXPECT_EQ(err, kDeviceOk);
    for (size_t t = 0; t < mixed.size(); ++t) {
      const bool mine = mixed[t] >= first && mixed[t] < first + rows;
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(out[t * hidden + i],
                  mine ? Bf16ToF32(table[mixed[t] * hidden + i]) : 0.0f)
            << "token " << t << " id " << mixed[t];
      }
    }
    mixed = {25, 50};
    ASSERT_EQ(LaunchEmbeddingGather(table.data() + first * hidden, vocab, first, rows,
                                    hidden, mixed.data(), 2, out.data(), &err, nullptr),
              nullptr);
    EXPECT_EQ(err, kTokenIdOutOfRange);
  }
}

TEST_P(Elementwise, PagedCacheWriteRoundsToBf16AndChecksSlots) {
  for (int64_t width : {576, 37}) {  // the MLA latent (float4), and odd
    for (int64_t pad : {0, 3}) {
      const int64_t slots_n = 10, ld = width + pad;
      auto src = Strided(3, width, ld);
      // Rounding ties (RNE), specials.
      src[0] = 1.0f + 1.0f / 256.0f;  // tie, rounds down to even
      src[1] = 1.0f + 3.0f / 256.0f;  // tie, rounds up to even
      src[2] = std::numeric_limits<float>::quiet_NaN();
      src[3] = -std::numeric_limits<float>::infinity();
      src[4] = 3.4e38f;  // rounds to +inf
      std::vector<uint16_t> want(slots_n * width, 0xAAAA), got = want;
      std::vector<int32_t> slots = {7, -1, 2};
      int32_t err = 0;
      ASSERT_TRUE(ref_->PagedCacheWrite(src.data(), ld, slots.data(), 3, width,
                                        want.data(), slots_n)
                      .ok());
      ASSERT_EQ(LaunchPagedCacheWrite(src.data(), ld, slots.data(), 3, width,
                                      got.data(), slots_n, &err, nullptr),
                nullptr);
      EXPECT_EQ(err, kDeviceOk);
      EXPECT_EQ(got, want) << "width " << width << " ld " << ld;
      EXPECT_EQ(got[7 * width + 0], 0x3F80);
      EXPECT_EQ(got[7 * width + 1], 0x3F82);
      EXPECT_EQ(got[7 * width + 4], 0x7F80);
      EXPECT_EQ(std::count(got.begin(), got.end(), 0xAAAA), (slots_n - 2) * width);
      // Out of range: recorded, skipped; the good rows are still written.
      std::vector<uint16_t> cache(slots_n * width, 0xAAAA);
      slots = {10, 4, -3};
      ASSERT_EQ(LaunchPagedCacheWrite(src.data(), ld, slots.data(), 3, width,
                                      cache.data(), slots_n, &err, nullptr),
                nullptr);
      EXPECT_EQ(err, kSlotOutOfRange);
      for (int64_t i = 0; i < width; ++i) {
        ASSERT_EQ(cache[4 * width + i], F32ToBf16(src[ld + i]));
      }
      EXPECT_EQ(std::count(cache.begin(), cache.end(), 0xAAAA), (slots_n - 1) * width);
    }
  }
}

// ---- Causal conv
// ------------------------------------------------------------------------

TEST_P(Elementwise, CausalConv1dCarriesStateAcrossCalls) {
  // The same stream fed in pieces (several shorter than kernel - 1, one spanning
  // three token chunks) must equal the oracle fed in one piece; the state is exact.
  for (int64_t kernel : {1, 2, 3, 4, 6}) {
    const int64_t channels = 37 + 128, ld = channels + 5;
    const std::vector<int64_t> pieces = {1, 2, 3, 5, 17, 70, 1};
    int64_t total = 0;
    for (int64_t p : pieces) total += p;
    auto x = Strided(total, channels, ld), w = Normal(channels * kernel, 0.5f);
    auto state0 = Normal((kernel - 1) * channels);
    auto want = Guards(total * ld), got = want;
    std::vector<float> ref_state = state0, state = state0;
    ASSERT_TRUE(ref_->CausalConv1dSilu(x.data(), ld, w.data(), kernel, ref_state.data(),
                                       want.data(), ld, total, channels)
                    .ok());
    int64_t t0 = 0;
    for (int64_t piece : pieces) {
      ASSERT_EQ(
          LaunchCausalConv1dSilu(x.data() + t0 * ld, ld, w.data(), kernel, state.data(),
                                 got.data() + t0 * ld, ld, piece, channels, nullptr),
          nullptr);
      t0 += piece;
    }
    const std::string what = "conv1d kernel " + std::to_string(kernel);
    ExpectClose(got, want, 1e-5, what + " outputs");
    EXPECT_EQ(state, ref_state) << what << " state";
    for (int64_t r = 0; r < kernel - 1; ++r) {
      for (int64_t c = 0; c < channels; ++c) {
        ASSERT_EQ(state[r * channels + c], x[(total - kernel + 1 + r) * ld + c]);
      }
    }
  }
  {  // One call shorter than the tail: the state shifts by one row.
    const int64_t kernel = 4, channels = 5;
    auto x = Normal(channels), w = Normal(channels * kernel), st = Normal(3 * channels);
    auto ref_st = st;
    std::vector<float> want(channels), got(channels);
    ASSERT_TRUE(ref_->CausalConv1dSilu(x.data(), channels, w.data(), kernel,
                                       ref_st.data(), want.data(), channels, 1,
                                       channels)
                    .ok());
    ASSERT_EQ(LaunchCausalConv1dSilu(x.data(), channels, w.data(), kernel, st.data(),
                                     got.data(), channels, 1, channels, nullptr),
              nullptr);
    ExpectClose(got, want, 1e-5, "conv1d T=1");
    EXPECT_EQ(st, ref_st);
  }
  // Known value: one token, zero state, w = [0,0,0,1] -> silu(x).
  float xs[1] = {2.0f}, ws[4] = {0, 0, 0, 1}, st[3] = {0, 0, 0}, ys[1];
  ASSERT_EQ(LaunchCausalConv1dSilu(xs, 1, ws, 4, st, ys, 1, 1, 1, nullptr), nullptr);
  EXPECT_NEAR(ys[0], 2.0f / (1.0f + std::exp(-2.0f)), 1e-6f);
  EXPECT_EQ(st[2], 2.0f);
}

// ---- Attention residual mix
// ---------------------------------------------------------------

TEST_P(Elementwise, AttnResMixMatchesTheOracleInPlace) {
  struct Shape {
    int64_t tokens, hidden, bank;
  };
  for (const Shape s : {Shape{5, 100, 0}, Shape{5, 100, 1}, Shape{5, 100, 3},
                        Shape{2, 7168, 4}, Shape{1, 33, 9}}) {
    const std::string what = "mix tokens " + std::to_string(s.tokens) + " hidden " +
                             std::to_string(s.hidden) + " bank " +
                             std::to_string(s.bank);
    auto proj = Normal(s.hidden, 0.3f), norm = Normal(s.hidden, 1.0f);
    std::vector<std::vector<float>> bank;
    std::vector<const float*> ptrs;  // the "device" pointer table
    for (int64_t j = 0; j < s.bank; ++j)
      bank.push_back(Normal(s.tokens * s.hidden, 2.0f));
    for (auto& b : bank) ptrs.push_back(b.data());
    auto p = Normal(s.tokens * s.hidden, 2.0f);
    std::vector<float> want(p.size()), got = p;
    ASSERT_TRUE(ref_->AttnResMix(ptrs.data(), s.bank, p.data(), proj.data(),
                                 norm.data(), 1e-5f, s.tokens, s.hidden, want.data())
                    .ok());
    std::vector<float> scratch(AttnResMixScratchBytes(s.tokens, s.bank) / sizeof(float),
                               kGuard);
    ASSERT_EQ(scratch.size(), static_cast<size_t>(s.tokens * (s.bank + 1)));
    // out == p (the engine's use).
    ASSERT_EQ(LaunchAttnResMix(ptrs.data(), s.bank, got.data(), proj.data(),
                               norm.data(), 1e-5f, s.tokens, s.hidden, got.data(),
                               scratch.data(), nullptr),
              nullptr);
    ExpectClose(got, want, 1e-5, what);
    if (s.bank == 0) ExpectClose(got, p, 1e-6, "mix of P alone is P");
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, Elementwise, ::testing::Values(0, 1, 2, 77),
                         [](const auto& info) {
                           return "seed" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace tandem::kernels::cuda
