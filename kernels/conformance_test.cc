// One conformance suite for every kernel backend: each op of each backend runs on
// the same inputs as the "cpu_reference" oracle and must agree within the bound
// stated at each test. Backends: cpu_reference itself (self-consistency and the
// chunked-vs-recurrent / absorbed-vs-expanded identities), and the optimised CPU
// backend at every ISA this machine supports (forced with CreateCpuBackend, not
// the environment), and the device backends through kernels/staging_backend.h
// (host vectors uploaded to buffers of exactly each op's extents, guard bytes
// around every output): "cuda_sim" (the GPU kernels on the SIMT emulator, default
// build) and "cuda" (--config=cuda builds where a GPU is visible), each also as
// its "_bf16" variant (tensor-core operands rounded to BF16 once; the ops it
// rounds have BF16 bounds, the rest the exact ones). kernels/conformance_backends.h
// lists and makes them. A device
// backend's tests of ops it does not Support() yet are skipped, naming the ops.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/bf16.h"
#include "kernels/conformance_backends.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/staging_backend.h"

namespace tandem::kernels {
namespace {

class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref_ = CreateReferenceBackend();
    be_ = MakeConformanceBackend(GetParam());
    ASSERT_NE(be_, nullptr);
  }
  // BF16-activation backends: AVX512_BF16, and the GPU backends' _bf16 variants
  // (cuBLASLt on X rounded to BF16). The exact GPU backends ("cuda", "cuda_sim")
  // split X into BF16 hi + lo and meet the fp32 bounds.
  bool IsBf16Gemm() const {
    return absl::StartsWith(GetParam(), "cpu_avx512_bf16") ||
           GpuBf16Operands(GetParam());
  }
  // The GPU _bf16 variants' MoE feeds the tensor cores z and the SiTU activation
  // rounded to BF16 (kernels/cuda/moe.h): norm-wise 1e-2 instead of 1e-4.
  bool IsBf16Moe() const { return GpuBf16Operands(GetParam()); }
  // The GPU _bf16 variants' MLA rounds its fp32 operands to BF16 on the tensor
  // cores (q, k_nope, v and p expanded; q and p absorbed: kernels/cuda/mla.h):
  // norm-wise 2e-2 instead of 2e-5.
  double MlaBound() const { return GpuBf16Operands(GetParam()) ? 2e-2 : 2e-5; }
  // The ops of `ops` this backend does not implement yet, comma-separated.
  std::string Missing(std::initializer_list<Op> ops) const {
    std::string missing;
    for (Op op : ops) {
      if (be_->Supports(op)) continue;
      if (!missing.empty()) missing += ", ";
      missing += std::string(OpName(op));
    }
    return missing;
  }

  std::vector<float> Normal(int64_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::vector<uint16_t> NormalBf16(int64_t n, float sd = 1.0f) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v)
      x = F32ToBf16(std::normal_distribution<float>(0.0f, sd)(rng_));
    return v;
  }

  std::mt19937 rng_{12345};
  std::unique_ptr<Backend> ref_;
  std::unique_ptr<Backend> be_;
};

// Skips the test on a backend that does not Support() every listed op (device
// backends whose op families are still being written).
#define REQUIRE_OPS(...)                                                           \
  do {                                                                             \
    const std::string missing_ops = Missing({__VA_ARGS__});                        \
    if (!missing_ops.empty()) {                                                    \
      GTEST_SKIP() << GetParam() << " does not support " << missing_ops << " yet"; \
    }                                                                              \
  } while (0)

// max_i |got - want| / (abs_floor + |scale_i|) <= bound, with a helpful message.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::vector<float>& scale, double bound,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  int64_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double s = scale.empty() ? 1.0 + std::fabs(want[i]) : 1e-30 + scale[i];
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) / s;
    if (!(e <= worst)) {  // NaN-safe: NaN always becomes the worst
      worst = std::isnan(e) ? INFINITY : e;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, bound) << what << ": worst at " << worst_i << " got " << got[worst_i]
                          << " want " << want[worst_i];
}

// Norm-wise: max|got - want| <= bound * max|want| (for outputs whose entries can
// cancel, e.g. attention and recurrent state).
void ExpectCloseNorm(const std::vector<float>& got, const std::vector<float>& want,
                     double bound, const std::string& what) {
  double mx = 0;
  for (float w : want) mx = std::max(mx, static_cast<double>(std::fabs(w)));
  std::vector<float> scale(want.size(), static_cast<float>(std::max(mx, 1e-20)));
  ExpectClose(got, want, scale, bound, what);
}

// ---- GEMM -------------------------------------------------------------------

struct GemmShape {
  int64_t m, n, k;
};

TEST_P(Conformance, GemmBf16AndF32) {
  REQUIRE_OPS(Op::kGemmBf16, Op::kGemmF32);
  // Bound: |err| <= tol * sum_k |x||w| (+1e-30). BF16 path (X rounded to BF16,
  // relative 2^-9 per product): tol 1e-2. fp32 paths: 1e-5.
  for (GemmShape s : {GemmShape{1, 7, 5}, GemmShape{3, 33, 100}, GemmShape{5, 130, 257},
                      GemmShape{17, 67, 2100}, GemmShape{1, 300, 4100},
                      GemmShape{64, 96, 513}, GemmShape{9, 5, 0}}) {
    for (bool accumulate : {false, true}) {
      const int64_t ldx = s.k + 3, ldw = s.k + 1, ldy = s.n + 2;
      auto x = Normal(s.m * ldx);
      auto wb = NormalBf16(s.n * ldw, 0.05f);
      auto wf = Normal(s.n * ldw, 0.05f);
      auto y0 = Normal(s.m * ldy);
      std::vector<float> scale_b(s.m * ldy, 0.0f), scale_f(s.m * ldy, 0.0f);
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < s.n; ++j) {
          double sb = 0, sf = 0;
          for (int64_t l = 0; l < s.k; ++l) {
            sb += std::fabs(x[i * ldx + l] * Bf16ToF32(wb[j * ldw + l]));
            sf += std::fabs(x[i * ldx + l] * wf[j * ldw + l]);
          }
          scale_b[i * ldy + j] =
              sb + (accumulate ? std::fabs(y0[i * ldy + j]) : 0) + 1e-6;
          scale_f[i * ldy + j] =
              sf + (accumulate ? std::fabs(y0[i * ldy + j]) : 0) + 1e-6;
        }
      }
      const std::string what = "m" + std::to_string(s.m) + " n" + std::to_string(s.n) +
                               " k" + std::to_string(s.k) + " acc" +
                               std::to_string(accumulate);
      std::vector<float> want = y0, got = y0;
      ASSERT_TRUE(ref_->GemmBf16(x.data(), ldx, wb.data(), ldw, want.data(), ldy, s.m,
                                 s.n, s.k, accumulate)
                      .ok());
      ASSERT_TRUE(be_->GemmBf16(x.data(), ldx, wb.data(), ldw, got.data(), ldy, s.m,
                                s.n, s.k, accumulate)
                      .ok());
      ExpectClose(got, want, scale_b, IsBf16Gemm() ? 1e-2 : 1e-5, "bf16 " + what);
      // Padding columns of Y (j >= n) are never written.
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = s.n; j < ldy; ++j)
          ASSERT_EQ(got[i * ldy + j], y0[i * ldy + j]);
      }
      want = y0;
      got = y0;
      ASSERT_TRUE(ref_->GemmF32(x.data(), ldx, wf.data(), ldw, want.data(), ldy, s.m,
                                s.n, s.k, accumulate)
                      .ok());
      ASSERT_TRUE(be_->GemmF32(x.data(), ldx, wf.data(), ldw, got.data(), ldy, s.m, s.n,
                               s.k, accumulate)
                      .ok());
      ExpectClose(got, want, scale_f, 1e-5, "f32 " + what);
    }
  }
}

TEST_P(Conformance, GemmRejectsBadStrides) {
  REQUIRE_OPS(Op::kGemmBf16);
  std::vector<float> x(16), y(16);
  std::vector<uint16_t> w(16);
  EXPECT_FALSE(
      be_->GemmBf16(x.data(), 2, w.data(), 4, y.data(), 4, 2, 2, 4, false).ok());
  EXPECT_FALSE(
      be_->GemmBf16(x.data(), 4, w.data(), 4, y.data(), 4, -1, 2, 4, false).ok());
}

// ---- Norms and element-wise -------------------------------------------------

TEST_P(Conformance, RmsNormL2NormAndElementwise) {
  REQUIRE_OPS(Op::kRmsNorm, Op::kL2NormHeads, Op::kSituGlu, Op::kMulSigmoid,
              Op::kAddInPlace);
  // fp32 vs fp64 reductions of <= 7168 terms: relative 1e-5 (tanh/exp: 1e-5).
  for (int64_t n : {1, 17, 128, 512, 1536, 7168}) {
    const int64_t rows = 5, ld = n + 3;
    auto x = Normal(rows * ld, 2.0f), w = Normal(n);
    std::vector<float> want(rows * ld, 0.0f), got(rows * ld, 0.0f);
    for (float eps : {1e-5f, 1e-6f}) {
      ASSERT_TRUE(
          ref_->RmsNorm(x.data(), ld, w.data(), want.data(), ld, rows, n, eps).ok());
      ASSERT_TRUE(
          be_->RmsNorm(x.data(), ld, w.data(), got.data(), ld, rows, n, eps).ok());
      ExpectClose(got, want, {}, 1e-5, "rmsnorm n" + std::to_string(n));
    }
  }
  {  // Per-head (KDA o_norm shape): rows = tokens * heads, n = head_dim, in place.
    auto x = Normal(3 * 96 * 128), w = Normal(128);
    std::vector<float> want(x.size()), got = x;
    ASSERT_TRUE(
        ref_->RmsNorm(x.data(), 128, w.data(), want.data(), 128, 3 * 96, 128, 1e-5f)
            .ok());
    ASSERT_TRUE(
        be_->RmsNorm(got.data(), 128, w.data(), got.data(), 128, 3 * 96, 128, 1e-5f)
            .ok());
    ExpectClose(got, want, {}, 1e-5, "rmsnorm per head in place");
  }
  {  // L2 norm per head with q scaling.
    const int64_t rows = 4, heads = 5, d = 24, ld = heads * d + 7;
    auto x = Normal(rows * ld);
    std::vector<float> want(rows * ld), got(rows * ld);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ASSERT_TRUE(
        ref_->L2NormHeads(x.data(), ld, want.data(), ld, rows, heads, d, 1e-6f, scale)
            .ok());
    ASSERT_TRUE(
        be_->L2NormHeads(x.data(), ld, got.data(), ld, rows, heads, d, 1e-6f, scale)
            .ok());
    for (int64_t r = 0; r < rows; ++r) {  // padding not compared
      for (int64_t i = heads * d; i < ld; ++i) want[r * ld + i] = got[r * ld + i] = 0;
    }
    ExpectClose(got, want, {}, 1e-5, "l2norm");
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(got[i]) * got[i];
    EXPECT_NEAR(ss, 1.0 / d, 1e-5);  // unit norm times d^-0.5
  }
  {  // SiTU-GLU over a wide range (tanh saturation on both sides), MulSigmoid, Add.
    const int64_t rows = 3, n = 257;
    auto g = Normal(rows * n, 20.0f), u = Normal(rows * n, 60.0f);
    std::vector<float> want(rows * n), got(rows * n);
    ASSERT_TRUE(
        ref_->SituGlu(g.data(), n, u.data(), n, want.data(), n, rows, n, 4.0f, 25.0f)
            .ok());
    ASSERT_TRUE(
        be_->SituGlu(g.data(), n, u.data(), n, got.data(), n, rows, n, 4.0f, 25.0f)
            .ok());
    ExpectClose(got, want, {}, 1e-5, "situ");
    // Known value: g = 0 -> a = 0; large g, u -> beta * lbeta.
    float g1[2] = {0.0f, 100.0f}, u1[2] = {3.0f, 1000.0f}, o1[2];
    ASSERT_TRUE(be_->SituGlu(g1, 2, u1, 2, o1, 2, 1, 2, 4.0f, 25.0f).ok());
    EXPECT_EQ(o1[0], 0.0f);
    EXPECT_NEAR(o1[1], 100.0f, 1e-3f);
    ASSERT_TRUE(
        ref_->MulSigmoid(g.data(), n, u.data(), n, want.data(), n, rows, n).ok());
    ASSERT_TRUE(be_->MulSigmoid(g.data(), n, u.data(), n, got.data(), n, rows, n).ok());
    ExpectClose(got, want, {}, 1e-5, "mul_sigmoid");
    want = g;
    got = g;
    ASSERT_TRUE(ref_->AddInPlace(want.data(), u.data(), rows * n).ok());
    ASSERT_TRUE(be_->AddInPlace(got.data(), u.data(), rows * n).ok());
    ExpectClose(got, want, {}, 0.0, "add");
  }
}

TEST_P(Conformance, EmbeddingGather) {
  REQUIRE_OPS(Op::kEmbeddingGather);
  const int64_t vocab = 50, hidden = 37;
  auto table = NormalBf16(vocab * hidden);
  std::vector<int32_t> ids = {0, 49, 7, 7, 13};
  std::vector<float> got(ids.size() * hidden);
  ASSERT_TRUE(be_->EmbeddingGather(table.data(), vocab, hidden, ids.data(), ids.size(),
                                   got.data())
                  .ok());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t i = 0; i < hidden; ++i) {
      ASSERT_EQ(got[t * hidden + i], Bf16ToF32(table[ids[t] * hidden + i]));
    }
  }
  std::vector<int32_t> bad = {3, 50};
  EXPECT_EQ(be_->EmbeddingGather(table.data(), vocab, hidden, bad.data(), 2, got.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  bad = {-1};
  EXPECT_FALSE(
      be_->EmbeddingGather(table.data(), vocab, hidden, bad.data(), 1, got.data())
          .ok());
}

// The vocabulary-parallel gather: each of three "ranks" holds a slice of the
// rows; a token's row comes from its owner, zeros from the others, so the sum
// over the slices is the full gather, exactly.
TEST_P(Conformance, EmbeddingGatherRowsOfASlice) {
  REQUIRE_OPS(Op::kEmbeddingGather);
  const int64_t vocab = 48, hidden = 64;
  auto table = NormalBf16(vocab * hidden);
  std::vector<int32_t> ids = {0, 47, 15, 16, 16, 31, 32, 5};
  std::vector<float> full(ids.size() * hidden), sum(ids.size() * hidden, 0.0f);
  ASSERT_TRUE(be_->EmbeddingGather(table.data(), vocab, hidden, ids.data(), ids.size(),
                                   full.data())
                  .ok());
  for (int64_t first = 0; first < vocab; first += 16) {
    std::vector<float> got(ids.size() * hidden, 7.0f);
    ASSERT_TRUE(be_->EmbeddingGatherRows(table.data() + first * hidden, vocab, first,
                                         16, hidden, ids.data(), ids.size(), got.data())
                    .ok());
    for (size_t t = 0; t < ids.size(); ++t) {
      const bool mine = ids[t] >= first && ids[t] < first + 16;
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(got[t * hidden + i], mine ? full[t * hidden + i] : 0.0f)
            << "slice " << first << " token " << t;
        sum[t * hidden + i] += got[t * hidden + i];
      }
    }
  }
  EXPECT_EQ(sum, full);
  // A slice outside the vocabulary, and an id outside it, are refused.
  std::vector<float> got(ids.size() * hidden);
  EXPECT_EQ(be_->EmbeddingGatherRows(table.data(), vocab, 40, 16, hidden, ids.data(),
                                     ids.size(), got.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad = {20, 48};
  absl::Status s = be_->EmbeddingGatherRows(table.data() + 16 * hidden, vocab, 16, 16,
                                            hidden, bad.data(), 2, got.data());
  if (s.ok()) s = be_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// ---- KDA -----------------------------------------------------------------------

TEST_P(Conformance, CausalConv1dCarriesStateAcrossCalls) {
  REQUIRE_OPS(Op::kCausalConv1dSilu);
  // Bound 1e-5 relative. The same stream fed in pieces of 1, 2, 3, 5 and 17 tokens
  // (several shorter than kernel - 1) must equal the oracle fed in one piece.
  const int64_t channels = 37, kernel = 4, total = 28, ld = channels + 5;
  auto x = Normal(total * ld), w = Normal(channels * kernel, 0.5f);
  auto state0 = Normal((kernel - 1) * channels);
  std::vector<float> want(total * ld, 0.0f), got(total * ld, 0.0f);
  std::vector<float> ref_state = state0, state = state0;
  ASSERT_TRUE(ref_->CausalConv1dSilu(x.data(), ld, w.data(), kernel, ref_state.data(),
                                     want.data(), ld, total, channels)
                  .ok());
  int64_t t0 = 0;
  for (int64_t piece : {1, 2, 3, 5, 17}) {
    ASSERT_TRUE(be_->CausalConv1dSilu(x.data() + t0 * ld, ld, w.data(), kernel,
                                      state.data(), got.data() + t0 * ld, ld, piece,
                                      channels)
                    .ok());
    t0 += piece;
  }
  ASSERT_EQ(t0, total);
  ExpectClose(got, want, {}, 1e-5, "conv1d outputs");
  ExpectClose(state, ref_state, {}, 0.0, "conv1d state");
  // The state is exactly the last kernel-1 inputs.
  for (int64_t r = 0; r < kernel - 1; ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      ASSERT_EQ(state[r * channels + c], x[(total - kernel + 1 + r) * ld + c]);
    }
  }
  // Known value: one token, zero state, w = [0,0,0,1] -> silu(x).
  float xs[1] = {2.0f}, ws[4] = {0, 0, 0, 1}, st[3] = {0, 0, 0}, ys[1];
  ASSERT_TRUE(be_->CausalConv1dSilu(xs, 1, ws, 4, st, ys, 1, 1, 1).ok());
  EXPECT_NEAR(ys[0], 2.0f / (1.0f + std::exp(-2.0f)), 1e-6f);
  EXPECT_EQ(st[2], 2.0f);
}

TEST_P(Conformance, KdaGatesAndOutputGate) {
  REQUIRE_OPS(Op::kKdaGates, Op::kKdaOutputGate);
  const int64_t tokens = 5, heads = 3, d = 16;
  auto graw = Normal(tokens * heads * d, 3.0f), a_log = Normal(heads, 0.5f),
       dt = Normal(heads * d), braw = Normal(tokens * heads, 2.0f);
  std::vector<float> g0(tokens * heads * d), b0(tokens * heads), g1 = g0, b1 = b0;
  ASSERT_TRUE(ref_->KdaGates(graw.data(), heads * d, a_log.data(), dt.data(),
                             braw.data(), heads, -5.0f, tokens, heads, d, g0.data(),
                             b0.data())
                  .ok());
  ASSERT_TRUE(be_->KdaGates(graw.data(), heads * d, a_log.data(), dt.data(),
                            braw.data(), heads, -5.0f, tokens, heads, d, g1.data(),
                            b1.data())
                  .ok());
  ExpectClose(g1, g0, {}, 1e-5, "kda g");
  ExpectClose(b1, b0, {}, 1e-5, "kda beta");
  for (float v : g1) ASSERT_TRUE(v < 0.0f && v > -5.0f) << v;
  auto o = Normal(tokens * heads * d), nw = Normal(d),
       gate = Normal(tokens * heads * d);
  std::vector<float> want(o.size()), got = o;
  ASSERT_TRUE(ref_->KdaOutputGate(o.data(), heads * d, nw.data(), gate.data(),
                                  heads * d, want.data(), heads * d, tokens, heads, d,
                                  1e-5f)
                  .ok());
  ASSERT_TRUE(be_->KdaOutputGate(got.data(), heads * d, nw.data(), gate.data(),
                                 heads * d, got.data(), heads * d, tokens, heads, d,
                                 1e-5f)
                  .ok());
  ExpectClose(got, want, {}, 1e-5, "kda output gate (in place)");
}

struct KdaInputs {
  int64_t tokens, heads, dk, dv;
  std::vector<float> q, k, v, g, beta, state;
};

KdaInputs MakeKda(std::mt19937& rng, Backend& ref, int64_t tokens, int64_t heads,
                  int64_t dk, int64_t dv, bool strong_decay) {
  KdaInputs in{tokens, heads, dk, dv, {}, {}, {}, {}, {}, {}};
  std::normal_distribution<float> n01(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& v, int64_t n, float sd) {
    v.resize(n);
    for (float& x : v) x = sd * n01(rng);
  };
  fill(in.q, tokens * heads * dk, 1.0f);
  fill(in.k, tokens * heads * dk, 1.0f);
  fill(in.v, tokens * heads * dv, 1.0f);
  fill(in.state, heads * dk * dv, 0.3f);
  EXPECT_TRUE(ref.L2NormHeads(in.q.data(), heads * dk, in.q.data(), heads * dk, tokens,
                              heads, dk, 1e-6f,
                              1.0f / std::sqrt(static_cast<float>(dk)))
                  .ok());
  EXPECT_TRUE(ref.L2NormHeads(in.k.data(), heads * dk, in.k.data(), heads * dk, tokens,
                              heads, dk, 1e-6f, 1.0f)
                  .ok());
  in.g.resize(tokens * heads * dk);
  for (int64_t i = 0; i < tokens * heads * dk; ++i) {
    // Strong: g ~ -5 so the cumulative gate reaches about -320 over a chunk on
    // most channels; some channels stay near 0 (slow decay).
    const float z = n01(rng) + (strong_decay ? (i % 5 == 0 ? -6.0f : 6.0f) : 0.0f);
    in.g[i] = -5.0f / (1.0f + std::exp(-z));
  }
  in.beta.resize(tokens * heads);
  for (float& b : in.beta) b = 1.0f / (1.0f + std::exp(-n01(rng)));
  return in;
}

KdaArgs ArgsFor(KdaInputs& in, std::vector<float>& state, std::vector<float>& out) {
  KdaArgs a;
  a.tokens = in.tokens;
  a.heads = in.heads;
  a.head_dim_k = in.dk;
  a.head_dim_v = in.dv;
  a.q = in.q.data();
  a.k = in.k.data();
  a.ld_qk = in.heads * in.dk;
  a.v = in.v.data();
  a.ld_v = in.heads * in.dv;
  a.g = in.g.data();
  a.beta = in.beta.data();
  state = in.state;
  a.state = state.data();
  out.assign(in.tokens * in.heads * in.dv, 0.0f);
  a.out = out.data();
  a.ld_out = in.heads * in.dv;
  return a;
}

TEST_P(Conformance, KdaRecurrentAndChunkedEqualTheRecurrence) {
  REQUIRE_OPS(Op::kKdaRecurrent, Op::kKdaChunked);
  // Both forms against the oracle's fp64 recurrence, norm-wise 1e-4 on outputs and
  // on the final state (carried initial state, strong and mild decays, partial
  // and exact chunks).
  struct Case {
    int64_t tokens, heads, dk, dv;
    bool strong;
  };
  for (Case c : {Case{1, 2, 128, 128, true}, Case{63, 2, 128, 128, true},
                 Case{64, 1, 128, 128, true}, Case{65, 2, 128, 128, false},
                 Case{200, 1, 128, 128, true}, Case{70, 3, 24, 40, false}}) {
    KdaInputs in = MakeKda(rng_, *ref_, c.tokens, c.heads, c.dk, c.dv, c.strong);
    std::vector<float> s_want, o_want, s_rec, o_rec, s_chunk, o_chunk;
    ASSERT_TRUE(ref_->KdaRecurrent(ArgsFor(in, s_want, o_want)).ok());
    ASSERT_TRUE(be_->KdaRecurrent(ArgsFor(in, s_rec, o_rec)).ok());
    ASSERT_TRUE(be_->KdaChunked(ArgsFor(in, s_chunk, o_chunk)).ok());
    const std::string what =
        "T=" + std::to_string(c.tokens) + " dk=" + std::to_string(c.dk);
    ExpectCloseNorm(o_rec, o_want, 1e-4, "recurrent out " + what);
    ExpectCloseNorm(s_rec, s_want, 1e-4, "recurrent state " + what);
    ExpectCloseNorm(o_chunk, o_want, 1e-4, "chunked out " + what);
    ExpectCloseNorm(s_chunk, s_want, 1e-4, "chunked state " + what);
  }
}

TEST_P(Conformance, KdaDecodeAfterChunkedPrefillEqualsOneRecurrence) {
  REQUIRE_OPS(Op::kKdaRecurrent, Op::kKdaChunked);
  // Prefill 100 tokens chunked, then decode 3 tokens one at a time with the
  // recurrence from the carried state == the recurrence over all 103 tokens.
  KdaInputs all = MakeKda(rng_, *ref_, 103, 2, 32, 32, true);
  std::vector<float> s_want, o_want;
  ASSERT_TRUE(ref_->KdaRecurrent(ArgsFor(all, s_want, o_want)).ok());
  std::vector<float> state, out, scratch;
  KdaArgs a = ArgsFor(all, state, out);
  a.tokens = 100;
  ASSERT_TRUE(be_->KdaChunked(a).ok());
  for (int64_t t = 100; t < 103; ++t) {
    KdaArgs d = a;
    d.tokens = 1;
    d.q = all.q.data() + t * a.ld_qk;
    d.k = all.k.data() + t * a.ld_qk;
    d.v = all.v.data() + t * a.ld_v;
    d.g = all.g.data() + t * 2 * 32;
    d.beta = all.beta.data() + t * 2;
    d.out = out.data() + t * a.ld_out;
    ASSERT_TRUE(be_->KdaRecurrent(d).ok());
  }
  ExpectCloseNorm(out, o_want, 1e-4, "prefill+decode outputs");
  ExpectCloseNorm(state, s_want, 1e-4, "prefill+decode state");
}

// ---- MLA -----------------------------------------------------------------------

struct MlaCase {
  int64_t heads, nope, rope, v, lora;
  std::vector<int32_t> ctx, q_len;
};

struct MlaSetup {
  MlaArgs args;
  std::vector<float> q, out;
  std::vector<uint16_t> cache, kv_b;
  std::vector<int32_t> seq_lens, query_start, tables;
};

// The same logical latent cache content laid out in blocks of block_size, with
// block ids shuffled (block 0 unused) so paging is exercised.
MlaSetup MakeMla(const MlaCase& c, int64_t block_size, uint32_t seed, Backend& writer) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  MlaSetup s;
  const int64_t width = c.lora + c.rope, seqs = c.ctx.size();
  int64_t max_blocks = 0, total_blocks = 1, tokens = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t b = (c.ctx[i] + block_size - 1) / block_size;
    max_blocks = std::max(max_blocks, b);
    total_blocks += b;
    tokens += c.q_len[i];
  }
  std::vector<int32_t> ids(total_blocks - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed + 1));
  s.tables.assign(seqs * max_blocks, -1);
  s.cache.assign(total_blocks * block_size * width, 0);
  int64_t next = 0;
  s.query_start.push_back(0);
  for (int64_t i = 0; i < seqs; ++i) {
    s.seq_lens.push_back(c.ctx[i]);
    s.query_start.push_back(s.query_start.back() + c.q_len[i]);
    const int64_t b = (c.ctx[i] + block_size - 1) / block_size;
    for (int64_t j = 0; j < b; ++j) s.tables[i * max_blocks + j] = ids[next++];
    // Latents depend only on (seq, position), not on the layout.
    std::mt19937 lr(seed * 7 + i);
    std::vector<float> lat(c.ctx[i] * width);
    for (float& x : lat) x = std::normal_distribution<float>(0.0f, 1.0f)(lr);
    std::vector<int32_t> slots(c.ctx[i]);
    for (int64_t p = 0; p < c.ctx[i]; ++p) {
      slots[p] =
          s.tables[i * max_blocks + p / block_size] * block_size + p % block_size;
    }
    EXPECT_TRUE(writer
                    .PagedCacheWrite(lat.data(), width, slots.data(), c.ctx[i], width,
                                     s.cache.data(), total_blocks * block_size)
                    .ok());
  }
  std::mt19937 qr(seed * 13);
  s.q.resize(tokens * c.heads * (c.nope + c.rope));
  for (float& x : s.q) x = std::normal_distribution<float>(0.0f, 1.0f)(qr);
  std::mt19937 wr(seed * 17);
  s.kv_b.resize(c.heads * (c.nope + c.v) * c.lora);
  for (uint16_t& x : s.kv_b) {
    x = F32ToBf16(std::normal_distribution<float>(0.0f, 0.3f / std::sqrt(8.0f))(wr));
  }
  s.out.assign(tokens * c.heads * c.v, 0.0f);
  MlaArgs& a = s.args;
  a.heads = c.heads;
  a.nope_dim = c.nope;
  a.rope_dim = c.rope;
  a.v_dim = c.v;
  a.kv_lora_rank = c.lora;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.nope + c.rope));
  a.num_seqs = seqs;
  a.seq_lens = s.seq_lens.data();
  a.query_start = s.query_start.data();
  a.block_tables = s.tables.data();
  a.block_table_stride = max_blocks;
  a.kv_cache = s.cache.data();
  a.num_blocks = total_blocks;
  a.block_size = block_size;
  a.kv_b_proj = s.kv_b.data();
  a.q = s.q.data();
  a.ld_q = c.heads * (c.nope + c.rope);
  a.out = s.out.data();
  a.ld_out = c.heads * c.v;
  (void)n01;
  return s;
}

TEST_P(Conformance, MlaAbsorbedEqualsExpandedPagedEqualsContiguous) {
  REQUIRE_OPS(Op::kPagedCacheWrite, Op::kMlaAttentionExpanded,
              Op::kMlaAttentionAbsorbed);
  // Norm-wise 2e-5: the same fp32 math in different association orders.
  const std::vector<MlaCase> cases = {
      // odd small dims; decode (q=1), prefill chunk with prefix (q=5), q == ctx.
      {3, 16, 8, 12, 64, {1, 37, 300, 9}, {1, 5, 1, 9}},
      // K3-shaped head slice: 2 heads, 128 + 64, v 128, latent 512 (576 cached).
      {2, 128, 64, 128, 512, {70, 3}, {3, 3}},
  };
  for (const MlaCase& c : cases) {
    // Oracle: expanded form on a contiguous cache (one block per sequence).
    int64_t max_ctx = *std::max_element(c.ctx.begin(), c.ctx.end());
    MlaSetup contiguous = MakeMla(c, max_ctx, 5, *ref_);
    ASSERT_TRUE(ref_->MlaAttentionExpanded(contiguous.args).ok());
    const std::vector<float> want = contiguous.out;
    for (int64_t block_size : {1, 16, 64}) {
      MlaSetup paged = MakeMla(c, block_size, 5, *be_);
      const std::string what = "heads " + std::to_string(c.heads) + " lora " +
                               std::to_string(c.lora) + " block " +
                               std::to_string(block_size);
      absl::Status st = be_->MlaAttentionExpanded(paged.args);
      ASSERT_TRUE(st.ok()) << st << " (" << what << ")";
      ExpectCloseNorm(paged.out, want, MlaBound(), "expanded " + what);
      std::fill(paged.out.begin(), paged.out.end(), 0.0f);
      st = be_->MlaAttentionAbsorbed(paged.args);
      ASSERT_TRUE(st.ok()) << st << " (" << what << ")";
      ExpectCloseNorm(paged.out, want, MlaBound(), "absorbed " + what);
    }
  }
}

TEST_P(Conformance, MlaSpeculativeQueriesAreCausal) {
  REQUIRE_OPS(Op::kPagedCacheWrite, Op::kMlaAttentionAbsorbed);
  // k = 4 query tokens: query i must equal a run whose context ends at its own
  // position (the later drafts are invisible to it).
  MlaCase c{2, 16, 8, 16, 32, {40}, {4}};
  MlaSetup s = MakeMla(c, 16, 9, *be_);
  ASSERT_TRUE(be_->MlaAttentionAbsorbed(s.args).ok());
  for (int32_t i = 0; i < 4; ++i) {
    MlaSetup one = MakeMla(c, 16, 9, *be_);
    one.seq_lens[0] = 40 - 3 + i;
    one.query_start = {0, 1};
    one.args.query_start = one.query_start.data();
    one.args.q = s.q.data() + i * s.args.ld_q;
    one.out.assign(c.heads * c.v, 0.0f);
    one.args.out = one.out.data();
    ASSERT_TRUE(be_->MlaAttentionAbsorbed(one.args).ok());
    std::vector<float> row(s.out.begin() + i * s.args.ld_out,
                           s.out.begin() + (i + 1) * s.args.ld_out);
    ExpectCloseNorm(row, one.out, 1e-6, "draft " + std::to_string(i));
  }
}

TEST_P(Conformance, MlaRejectsBadBlockIds) {
  REQUIRE_OPS(Op::kPagedCacheWrite, Op::kMlaAttentionExpanded,
              Op::kMlaAttentionAbsorbed);
  MlaCase c{1, 8, 8, 8, 32, {20}, {1}};
  MlaSetup s = MakeMla(c, 8, 3, *be_);
  s.tables[1] = static_cast<int32_t>(s.args.num_blocks);
  EXPECT_EQ(be_->MlaAttentionAbsorbed(s.args).code(),
            absl::StatusCode::kInvalidArgument);
  s.tables[1] = 1;
  s.seq_lens[0] = 100;  // needs more blocks than the table holds
  EXPECT_FALSE(be_->MlaAttentionExpanded(s.args).ok());
}

TEST_P(Conformance, PagedCacheWriteRoundsToBf16AndSkipsPadding) {
  REQUIRE_OPS(Op::kPagedCacheWrite);
  const int64_t width = 576, slots_n = 10;
  auto src = Normal(3 * width);
  std::vector<uint16_t> cache(slots_n * width, 0xAAAA);
  std::vector<int32_t> slots = {7, -1, 2};
  ASSERT_TRUE(be_->PagedCacheWrite(src.data(), width, slots.data(), 3, width,
                                   cache.data(), slots_n)
                  .ok());
  for (int64_t i = 0; i < width; ++i) {
    ASSERT_EQ(cache[7 * width + i], F32ToBf16(src[i]));
    ASSERT_EQ(cache[2 * width + i], F32ToBf16(src[2 * width + i]));
  }
  int64_t untouched = std::count(cache.begin(), cache.end(), 0xAAAA);
  EXPECT_EQ(untouched, (slots_n - 2) * width);
  slots = {10};
  EXPECT_FALSE(be_->PagedCacheWrite(src.data(), width, slots.data(), 1, width,
                                    cache.data(), slots_n)
                   .ok());
}

// ---- Router and MoE ----------------------------------------------------------------

TEST_P(Conformance, RouterTopKMatchesOracle) {
  REQUIRE_OPS(Op::kRouterTopK);
  const int64_t tokens = 9, hidden = 200, experts = 37, top_k = 6;
  auto x = Normal(tokens * hidden);
  auto gate = NormalBf16(experts * hidden, 0.1f);
  auto bias = Normal(experts, 0.05f);
  for (bool renorm : {true, false}) {
    std::vector<int32_t> ids0(tokens * top_k), ids1(tokens * top_k);
    std::vector<float> w0(tokens * top_k), w1(tokens * top_k);
    ASSERT_TRUE(ref_->RouterTopK(x.data(), hidden, gate.data(), bias.data(), tokens,
                                 hidden, experts, top_k, renorm, 2.5f, ids0.data(),
                                 w0.data())
                    .ok());
    ASSERT_TRUE(be_->RouterTopK(x.data(), hidden, gate.data(), bias.data(), tokens,
                                hidden, experts, top_k, renorm, 2.5f, ids1.data(),
                                w1.data())
                    .ok());
    EXPECT_EQ(ids1, ids0);
    ExpectClose(w1, w0, {}, 1e-5, "router weights");
    if (renorm) {
      double sum = 0;
      for (int64_t i = 0; i < top_k; ++i) sum += w1[i];
      EXPECT_NEAR(sum, 2.5, 1e-5);
    }
  }
  // Exact ties (x = 0: every s = 0.5): the lower expert id wins; bias breaks ties
  // only through the selection key, the weights stay the pre-bias s.
  std::vector<float> zero(hidden, 0.0f), tie_bias(experts, 0.0f);
  tie_bias[30] = 0.25f;
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  ASSERT_TRUE(be_->RouterTopK(zero.data(), hidden, gate.data(), tie_bias.data(), 1,
                              hidden, experts, 4, true, 1.0f, ids.data(), w.data())
                  .ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{30, 0, 1, 2}));
  for (float v : w) EXPECT_NEAR(v, 0.25f, 1e-6f);
}

struct Mxfp4Weights {
  std::vector<uint8_t> packed[3], scale[3];  // w1, w3, w2
};

Mxfp4Weights RandomExpert(std::mt19937& rng, int64_t hidden, int64_t inter) {
  Mxfp4Weights w;
  const int64_t rows[3] = {inter, inter, hidden}, cols[3] = {hidden, hidden, inter};
  std::uniform_int_distribution<int> byte(0, 255), sc(120, 124);
  for (int i = 0; i < 3; ++i) {
    w.packed[i].resize(rows[i] * cols[i] / 2);
    w.scale[i].resize(rows[i] * cols[i] / 32);
    for (uint8_t& b : w.packed[i]) b = static_cast<uint8_t>(byte(rng));
    for (uint8_t& b : w.scale[i]) b = static_cast<uint8_t>(sc(rng));
  }
  return w;
}

TEST_P(Conformance, MoeMxfp4EqualsDequantiseThenGemm) {
  REQUIRE_OPS(Op::kMoeMxfp4);
  // Norm-wise 1e-4 (fp32 vs fp64 accumulation over <= 512-term sums of exactly
  // dequantised weights; 1e-2 for the BF16 tensor-core path of the GPU backend). Tokens
  // routed to 1..7 experts, one id -1 (padding) and one expert owned by another rank
  // (null weights).
  for (auto [hidden, inter, tokens] :
       {std::tuple<int64_t, int64_t, int64_t>{64, 96, 7}, {512, 384, 6}}) {
    const int64_t num_experts = 5, top_k = 3;
    std::vector<Mxfp4Weights> store;
    std::vector<Mxfp4Expert> experts(num_experts);
    for (int64_t e = 0; e < num_experts; ++e) {
      store.push_back(RandomExpert(rng_, hidden, inter));
    }
    for (int64_t e = 0; e < num_experts; ++e) {
      if (e == 3) continue;  // not local
      experts[e] = {store[e].packed[0].data(), store[e].scale[0].data(),
                    store[e].packed[1].data(), store[e].scale[1].data(),
                    store[e].packed[2].data(), store[e].scale[2].data()};
    }
    auto z = Normal(tokens * hidden, 0.5f);
    std::vector<int32_t> ids(tokens * top_k);
    std::vector<float> wts(tokens * top_k);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < top_k; ++i) {
        ids[t * top_k + i] = static_cast<int32_t>((t * 2 + i * 3) % num_experts);
        wts[t * top_k + i] = 0.2f + 0.1f * i;
      }
    }
    ids[4] = -1;
    MoeArgs a;
    a.tokens = tokens;
    a.hidden = hidden;
    a.inter = inter;
    a.top_k = top_k;
    a.num_experts = num_experts;
    a.experts = experts.data();
    a.z = z.data();
    a.ld_z = hidden;
    a.ids = ids.data();
    a.weights = wts.data();
    std::vector<float> want(tokens * hidden), got(tokens * hidden, 123.0f);
    a.out = want.data();
    a.ld_out = hidden;
    ASSERT_TRUE(ref_->MoeMxfp4(a).ok());
    a.out = got.data();
    ASSERT_TRUE(be_->MoeMxfp4(a).ok());
    ExpectCloseNorm(got, want, IsBf16Moe() ? 1e-2 : 1e-4,
                    "moe hidden " + std::to_string(hidden));
  }
}

TEST_P(Conformance, MoeMxfp4KnownValues) {
  REQUIRE_OPS(Op::kMoeMxfp4);
  // One expert, hidden = inter = 32: w1 = w3 = all code 2 (1.0) with scale 2^1,
  // w2 = code 9 (-0.5) at scale 2^0. z = 0.01 everywhere: h = 2 * 32 * 0.01 = 0.64.
  const int64_t n = 32;
  std::vector<uint8_t> p13(n * n / 2, 0x22), s13(n, 128), p2(n * n / 2, 0x99),
      s2(n, 127);
  Mxfp4Expert ex = {p13.data(), s13.data(), p13.data(),
                    s13.data(), p2.data(),  s2.data()};
  std::vector<float> z(n, 0.01f), out(n);
  int32_t id = 0;
  float wt = 1.5f;
  MoeArgs a;
  a.tokens = 1;
  a.hidden = n;
  a.inter = n;
  a.top_k = 1;
  a.num_experts = 1;
  a.experts = &ex;
  a.z = z.data();
  a.ld_z = n;
  a.ids = &id;
  a.weights = &wt;
  a.out = out.data();
  a.ld_out = n;
  ASSERT_TRUE(be_->MoeMxfp4(a).ok());
  const double h = 0.64;
  const double act = 4 * std::tanh(h / 4) / (1 + std::exp(-h)) * 25 * std::tanh(h / 25);
  const double want = 1.5 * (-0.5 * 32 * act);
  for (float v : out) EXPECT_NEAR(v, want, IsBf16Moe() ? 1e-2 * std::fabs(want) : 1e-5);
  a.hidden = 48;  // not a multiple of 32
  EXPECT_FALSE(be_->MoeMxfp4(a).ok());
}

// ---- Attention residuals
// --------------------------------------------------------------

TEST_P(Conformance, AttnResMix) {
  REQUIRE_OPS(Op::kAttnResMix);
  // Relative 1e-5 per element.
  const int64_t tokens = 5, hidden = 100;
  auto proj = Normal(hidden, 0.3f), norm = Normal(hidden, 1.0f);
  for (int64_t bank_size : {0, 1, 3}) {
    std::vector<std::vector<float>> bank;
    std::vector<const float*> ptrs;
    for (int64_t j = 0; j < bank_size; ++j)
      bank.push_back(Normal(tokens * hidden, 2.0f));
    for (auto& b : bank) ptrs.push_back(b.data());
    auto p = Normal(tokens * hidden, 2.0f);
    std::vector<float> want(tokens * hidden), got = p;
    ASSERT_TRUE(ref_->AttnResMix(ptrs.data(), bank_size, p.data(), proj.data(),
                                 norm.data(), 1e-5f, tokens, hidden, want.data())
                    .ok());
    ASSERT_TRUE(be_->AttnResMix(ptrs.data(), bank_size, got.data(), proj.data(),
                                norm.data(), 1e-5f, tokens, hidden, got.data())
                    .ok());
    ExpectClose(got, want, {}, 1e-5, "mix bank " + std::to_string(bank_size));
    if (bank_size == 0) ExpectClose(got, p, {}, 1e-6, "mix of P alone is P");
  }
}

// ---- Integrity ------------------------------------------------------------------

TEST_P(Conformance, ChunkHashesEqualTheReference) {
  REQUIRE_OPS(Op::kChunkHashes);
  // Bit-exact: XXH64 per chunk of a stream cut into segments of awkward sizes
  // (zero-byte ones, odd lengths, unaligned starts), against libxxhash.
  std::vector<uint8_t> pool(20000);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(rng_());
  struct Case {
    std::vector<int64_t> sizes;  // segment lengths in stream order
    int64_t chunk;
  };
  const std::vector<Case> cases = {
      {{0}, 64},
      {{1}, 64},
      {{4095}, 4096},
      {{4096}, 4096},
      {{4097}, 4096},
      {{3, 0, 29, 1, 64, 7, 0, 901}, 32},
      {{100, 200, 300}, 1},
      {{9000, 33, 5}, 4096},
      {{13, 13, 13, 13, 13, 13, 13, 13}, 31},
  };
  for (const Case& c : cases) {
    std::vector<ByteSegment> segs;
    int64_t at = 0, src = 1;  // odd source offsets: unaligned data pointers
    for (int64_t n : c.sizes) {
      segs.push_back({pool.data() + src, at, n});
      at += n;
      src += n + 3;
    }
    ChunkHashArgs a;
    a.segments = segs.data();
    a.num_segments = static_cast<int64_t>(segs.size());
    a.total_bytes = at;
    a.chunk_bytes = c.chunk;
    const int64_t chunks = (at + c.chunk - 1) / c.chunk;
    std::vector<uint64_t> want(chunks + 1, 0x5555), got(chunks + 1, 0x5555);
    a.hashes = want.data();
    ASSERT_TRUE(ref_->ChunkHashes(a).ok());
    a.hashes = got.data();
    ASSERT_TRUE(be_->ChunkHashes(a).ok()) << "total " << at << " chunk " << c.chunk;
    ASSERT_TRUE(be_->Synchronize().ok());
    EXPECT_EQ(got, want) << "total " << at << " chunk " << c.chunk;
    EXPECT_EQ(got.back(), 0x5555u) << "wrote past the last chunk";
  }
  // A table that does not cover total_bytes contiguously.
  std::vector<ByteSegment> gap = {{pool.data(), 0, 10}, {pool.data(), 11, 10}};
  std::vector<uint64_t> out(4);
  ChunkHashArgs bad;
  bad.segments = gap.data();
  bad.num_segments = 2;
  bad.total_bytes = 21;
  bad.chunk_bytes = 8;
  bad.hashes = out.data();
  EXPECT_EQ(be_->ChunkHashes(bad).code(), absl::StatusCode::kInvalidArgument);
  bad.num_segments = 1;  // 10 bytes held, 21 claimed
  EXPECT_EQ(be_->ChunkHashes(bad).code(), absl::StatusCode::kInvalidArgument);
  bad.chunk_bytes = 0;
  EXPECT_EQ(be_->ChunkHashes(bad).code(), absl::StatusCode::kInvalidArgument);
  (void)be_->Synchronize();
}

// ---- Empty batches -------------------------------------------------------------

TEST_P(Conformance, EmptyBatchesAreNoOps) {
  // Zero rows / tokens / sequences: OK, nothing written, carried state unchanged
  // (a device backend must not launch an empty grid, which CUDA rejects).
  for (int i = 0; i < kNumOps; ++i) {
    // The optional vision ops: kernels/vision_conformance_test.cc.
    if (IsVisionOp(static_cast<Op>(i))) continue;
    if (!be_->Supports(static_cast<Op>(i))) {
      GTEST_SKIP() << GetParam() << " does not support " << OpName(static_cast<Op>(i))
                   << " yet";
    }
  }
  std::vector<float> f(64, 0.5f), out(64, 7.0f), out2(64, 7.0f);
  const std::vector<float> sevens(64, 7.0f);
  std::vector<uint16_t> wb(64, F32ToBf16(0.25f)), cache(64, 0xAAAA);
  std::vector<int32_t> ids(8, 0);
  std::vector<uint8_t> bytes(32 * 32 / 2, 0x22);  // one 32x32 MXFP4 matrix
  EXPECT_TRUE(
      be_->GemmBf16(f.data(), 4, wb.data(), 4, out.data(), 4, 0, 4, 4, false).ok());
  EXPECT_TRUE(
      be_->GemmF32(f.data(), 4, f.data(), 4, out.data(), 4, 0, 4, 4, true).ok());
  EXPECT_TRUE(be_->RmsNorm(f.data(), 4, f.data(), out.data(), 4, 0, 4, 1e-5f).ok());
  EXPECT_TRUE(be_->L2NormHeads(f.data(), 8, out.data(), 8, 0, 2, 4, 1e-6f, 1.0f).ok());
  EXPECT_TRUE(
      be_->SituGlu(f.data(), 4, f.data(), 4, out.data(), 4, 0, 4, 4.0f, 25.0f).ok());
  EXPECT_TRUE(be_->MulSigmoid(f.data(), 4, f.data(), 4, out.data(), 4, 0, 4).ok());
  EXPECT_TRUE(be_->AddInPlace(out.data(), f.data(), 0).ok());
  EXPECT_TRUE(be_->EmbeddingGather(wb.data(), 8, 8, ids.data(), 0, out.data()).ok());
  std::vector<float> state(3 * 4, 1.5f);
  EXPECT_TRUE(
      be_->CausalConv1dSilu(f.data(), 4, f.data(), 4, state.data(), out.data(), 4, 0, 4)
          .ok());
  EXPECT_EQ(state, std::vector<float>(3 * 4, 1.5f)) << "conv state after 0 tokens";
  EXPECT_TRUE(be_->KdaGates(f.data(), 8, f.data(), f.data(), f.data(), 2, -5.0f, 0, 2,
                            4, out.data(), out2.data())
                  .ok());
  EXPECT_TRUE(be_->KdaOutputGate(f.data(), 8, f.data(), f.data(), 8, out.data(), 8, 0,
                                 2, 4, 1e-5f)
                  .ok());
  EXPECT_TRUE(
      be_->PagedCacheWrite(f.data(), 8, ids.data(), 0, 8, cache.data(), 8).ok());
  EXPECT_EQ(cache, std::vector<uint16_t>(64, 0xAAAA));
  for (bool chunked : {false, true}) {
    std::vector<float> kda_state(2 * 4 * 4, 0.75f);
    KdaArgs k;
    k.tokens = 0;
    k.heads = 2;
    k.head_dim_k = 4;
    k.head_dim_v = 4;
    k.q = k.k = k.v = k.g = k.beta = f.data();
    k.ld_qk = k.ld_v = k.ld_out = 8;
    k.state = kda_state.data();
    k.out = out.data();
    EXPECT_TRUE((chunked ? be_->KdaChunked(k) : be_->KdaRecurrent(k)).ok());
    EXPECT_EQ(kda_state, std::vector<float>(2 * 4 * 4, 0.75f)) << "kda state, T = 0";
  }
  {
    MlaArgs a;
    a.heads = 2;
    a.nope_dim = 4;
    a.rope_dim = 4;
    a.v_dim = 4;
    a.kv_lora_rank = 8;
    a.scale = 0.3f;
    a.num_seqs = 0;
    a.block_size = 4;
    a.num_blocks = 2;
    a.block_table_stride = 1;
    std::vector<int32_t> qs = {0};
    std::vector<uint16_t> mla_cache(2 * 4 * (8 + 4)), kv_b(2 * (4 + 4) * 8);
    a.seq_lens = ids.data();
    a.query_start = qs.data();
    a.block_tables = ids.data();
    a.kv_cache = mla_cache.data();
    a.kv_b_proj = kv_b.data();
    a.q = f.data();
    a.ld_q = 16;
    a.out = out.data();
    a.ld_out = 8;
    EXPECT_TRUE(be_->MlaAttentionExpanded(a).ok());
    EXPECT_TRUE(be_->MlaAttentionAbsorbed(a).ok());
  }
  EXPECT_TRUE(be_->RouterTopK(f.data(), 4, wb.data(), f.data(), 0, 4, 8, 2, true, 1.0f,
                              ids.data(), out.data())
                  .ok());
  {
    Mxfp4Expert ex = {bytes.data(), bytes.data(), bytes.data(),
                      bytes.data(), bytes.data(), bytes.data()};
    MoeArgs a;
    a.tokens = 0;
    a.hidden = 32;
    a.inter = 32;
    a.top_k = 1;
    a.num_experts = 1;
    a.experts = &ex;
    a.z = f.data();
    a.ld_z = 32;
    a.ids = ids.data();
    a.weights = f.data();
    a.out = out.data();
    a.ld_out = 32;
    EXPECT_TRUE(be_->MoeMxfp4(a).ok());
  }
  const float* bank[1] = {f.data()};
  EXPECT_TRUE(
      be_->AttnResMix(bank, 1, f.data(), f.data(), f.data(), 1e-5f, 0, 8, out.data())
          .ok());
  EXPECT_TRUE(be_->Synchronize().ok());
  EXPECT_EQ(out, sevens) << "an empty op wrote its output";
  EXPECT_EQ(out2, sevens) << "an empty op wrote its output";
}

TEST_P(Conformance, MlaSequencesWithoutQueriesInABatch) {
  // A batch where some sequences have no query tokens this step (q_len 0, first,
  // middle and last) equals the oracle.
  REQUIRE_OPS(Op::kPagedCacheWrite, Op::kMlaAttentionExpanded,
              Op::kMlaAttentionAbsorbed);
  MlaCase c{3, 16, 8, 16, 32, {7, 20, 33, 5}, {0, 3, 0, 1}};
  MlaSetup want = MakeMla(c, 16, 21, *ref_);
  ASSERT_TRUE(ref_->MlaAttentionExpanded(want.args).ok());
  for (bool absorbed : {false, true}) {
    MlaSetup got = MakeMla(c, 16, 21, *be_);
    absl::Status st = absorbed ? be_->MlaAttentionAbsorbed(got.args)
                               : be_->MlaAttentionExpanded(got.args);
    ASSERT_TRUE(st.ok()) << st;
    ExpectCloseNorm(got.out, want.out, MlaBound(), absorbed ? "absorbed" : "expanded");
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Conformance,
                         ::testing::ValuesIn(ConformanceBackendNames()),
                         [](const auto& info) { return info.param; });

// Batch invariance of the exact backends (every optimised ISA except the opt-in
// BF16-activation one): a row's GEMM output and a token's MoE output are bit for
// bit the same whether computed alone or inside a larger batch, across the GEMV
// (M <= 3) and blocked kernels, K blocks (> 2048), tails, thread splits and
// work-claiming order.
TEST(ExactBatchInvariance, GemmRowsAndMoeTokensDoNotDependOnTheBatch) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (static_cast<int>(isa) > static_cast<int>(HardwareIsa())) continue;
    for (int threads : {1, 2, 3}) {
      auto be = CreateCpuBackend(isa, threads, /*use_onednn=*/false);
      ASSERT_TRUE(be.ok());
      const std::string what =
          std::string(IsaName(isa)) + " threads " + std::to_string(threads);
      for (GemmShape s : {GemmShape{13, 200, 40}, GemmShape{9, 77, 1000},
                          GemmShape{7, 33, 4200}, GemmShape{70, 130, 96}}) {
        std::vector<float> x(s.m * s.k), big(s.m * s.n), one(s.n);
        std::vector<uint16_t> w(s.n * s.k);
        for (float& v : x) v = nd(rng);
        for (uint16_t& v : w) v = F32ToBf16(nd(rng));
        ASSERT_TRUE((*be)
                        ->GemmBf16(x.data(), s.k, w.data(), s.k, big.data(), s.n, s.m,
                                   s.n, s.k, false)
                        .ok());
        for (int64_t r = 0; r < s.m; ++r) {
          ASSERT_TRUE((*be)
                          ->GemmBf16(x.data() + r * s.k, s.k, w.data(), s.k, one.data(),
                                     s.n, 1, s.n, s.k, false)
                          .ok());
          for (int64_t j = 0; j < s.n; ++j) {
            ASSERT_EQ(one[j], big[r * s.n + j])
                << what << " m " << s.m << " n " << s.n << " k " << s.k << " row " << r
                << " col " << j;
          }
          // Every sub-batch size that contains row r gives the same bits too.
          const int64_t sub = 1 + (r % 5);
          if (r + sub <= s.m) {
            std::vector<float> part(sub * s.n);
            ASSERT_TRUE((*be)
                            ->GemmBf16(x.data() + r * s.k, s.k, w.data(), s.k,
                                       part.data(), s.n, sub, s.n, s.k, false)
                            .ok());
            for (int64_t j = 0; j < s.n; ++j)
              ASSERT_EQ(part[j], big[r * s.n + j]) << what;
          }
        }
      }
      // MoE: 6 tokens, 4 experts, top 2, against each token alone.
      const int64_t hidden = 128, inter = 96, tokens = 6, ne = 4, top_k = 2;
      std::vector<Mxfp4Weights> store;
      std::vector<Mxfp4Expert> experts(ne);
      for (int64_t e = 0; e < ne; ++e)
        store.push_back(RandomExpert(rng, hidden, inter));
      for (int64_t e = 0; e < ne; ++e) {
        experts[e] = {store[e].packed[0].data(), store[e].scale[0].data(),
                      store[e].packed[1].data(), store[e].scale[1].data(),
                      store[e].packed[2].data(), store[e].scale[2].data()};
      }
      std::vector<float> z(tokens * hidden), wts(tokens * top_k);
      std::vector<int32_t> ids(tokens * top_k);
      for (float& v : z) v = 0.5f * nd(rng);
      for (int64_t t = 0; t < tokens; ++t) {
        ids[t * top_k] = static_cast<int32_t>(t % ne);
        ids[t * top_k + 1] = static_cast<int32_t>((t + 1 + t / 2) % ne);
        wts[t * top_k] = 0.6f;
        wts[t * top_k + 1] = 0.3f + 0.01f * t;
      }
      MoeArgs a;
      a.tokens = tokens;
      a.hidden = hidden;
      a.inter = inter;
      a.top_k = top_k;
      a.num_experts = ne;
      a.experts = experts.data();
      a.z = z.data();
      a.ld_z = hidden;
      a.ids = ids.data();
      a.weights = wts.data();
      std::vector<float> all(tokens * hidden), alone(hidden);
      a.out = all.data();
      a.ld_out = hidden;
      ASSERT_TRUE((*be)->MoeMxfp4(a).ok());
      for (int64_t t = 0; t < tokens; ++t) {
        MoeArgs b = a;
        b.tokens = 1;
        b.z = z.data() + t * hidden;
        b.ids = ids.data() + t * top_k;
        b.weights = wts.data() + t * top_k;
        b.out = alone.data();
        ASSERT_TRUE((*be)->MoeMxfp4(b).ok());
        for (int64_t i = 0; i < hidden; ++i) {
          ASSERT_EQ(alone[i], all[t * hidden + i]) << what << " moe token " << t;
        }
      }
    }
  }
}

TEST(BackendFactoryTest, KnownAndUnknownNames) {
  auto cpu = CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  // Exact mode stops at AVX-512 (fp32 activations); cpu_bf16 takes the best ISA.
  const CpuIsa exact = static_cast<CpuIsa>(
      std::min(static_cast<int>(ActiveIsa()), static_cast<int>(CpuIsa::kAvx512)));
  EXPECT_EQ((*cpu)->name(), std::string("cpu_") + std::string(IsaName(exact)));
  auto fast = CreateBackend("cpu_bf16");
  ASSERT_TRUE(fast.ok());
  EXPECT_EQ((*fast)->name(), std::string("cpu_") + std::string(IsaName(ActiveIsa())));
  auto ref = CreateBackend("cpu_reference");
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ((*ref)->name(), "cpu_reference");
  EXPECT_EQ(CreateBackend("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  // The device backends: each one is FailedPrecondition in the build without it
  // ("cuda" also where no GPU is visible); the default build always has cuda_sim.
  auto sim = CreateBackend("cuda_sim");
  auto gpu = CreateBackend("cuda");
  if (sim.ok()) {
    EXPECT_EQ((*sim)->name(), "cuda_sim");
    EXPECT_EQ((*sim)->device().name(), "cuda_sim");
    EXPECT_FALSE(gpu.ok());
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(gpu.status().message(), "--config=cuda"))
        << gpu.status();
  } else {
    EXPECT_EQ(sim.status().code(), absl::StatusCode::kFailedPrecondition);
    if (!gpu.ok()) {
      EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
    }
  }
}

// ---- Device backends: residency, the device error word, guard bytes --------------

// The device backend of this build itself (not through the staging adapter):
// cuda_sim, or cuda where a GPU is visible; nullptr otherwise.
std::unique_ptr<Backend> RawDeviceBackend() {
  auto be = cuda::CreateCudaSimBackend();
  if (!be.ok()) be = cuda::CreateCudaBackend();
  return be.ok() ? std::move(be).value() : nullptr;
}

TEST(DeviceBackend, HostPointersAreRejected) {
  auto be = RawDeviceBackend();
  if (be == nullptr) GTEST_SKIP() << "no device backend in this build";
  if (!be->device().host_addressable()) {
    GTEST_SKIP() << be->name() << " checks residency only where it is cheap (cuda_sim)";
  }
  const int64_t m = 3, n = 5, k = 7;
  std::vector<float> x(m * k, 1.0f), w(n * k, 0.5f), y(m * n, 0.0f);
  absl::Status st = be->GemmF32(x.data(), k, w.data(), k, y.data(), n, m, n, k, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "not memory of device cuda_sim")) << st;
  // The same op on device buffers runs; one buffer short by one element does not.
  Device& dev = be->device();
  auto dx = DeviceBuffer::Allocate(&dev, x.size() * sizeof(float));
  auto dw = DeviceBuffer::Allocate(&dev, w.size() * sizeof(float));
  auto dy = DeviceBuffer::Allocate(&dev, y.size() * sizeof(float));
  ASSERT_TRUE(dx.ok() && dw.ok() && dy.ok());
  ASSERT_TRUE(dev.CopyToDevice(dx->data(), x.data(), dx->bytes()).ok());
  ASSERT_TRUE(dev.CopyToDevice(dw->data(), w.data(), dw->bytes()).ok());
  ASSERT_TRUE(be->GemmF32(dx->as<float>(), k, dw->as<float>(), k, dy->as<float>(), n, m,
                          n, k, false)
                  .ok());
  ASSERT_TRUE(be->Synchronize().ok());
  ASSERT_TRUE(dev.CopyToHost(y.data(), dy->data(), dy->bytes()).ok());
  for (float v : y) EXPECT_EQ(v, 0.5f * k);
  st = be->GemmF32(dx->as<float>() + 1, k, dw->as<float>(), k, dy->as<float>(), n, m, n,
                   k, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "gemm x")) << st;
}

TEST(DeviceBackend, DeviceErrorWordComesBackFromSynchronizeOnce) {
  auto be = RawDeviceBackend();
  if (be == nullptr) GTEST_SKIP() << "no device backend in this build";
  auto* gpu = static_cast<cuda::GpuBackend*>(be.get());
  ASSERT_NE(gpu->error_word(), nullptr);
  ASSERT_TRUE(be->Synchronize().ok());
  // What a kernel does on a bad index: atomicCAS(error_word, 0, code).
  const int32_t code = cuda::kSlotOutOfRange;
  ASSERT_TRUE(be->device().CopyToDevice(gpu->error_word(), &code, sizeof code).ok());
  absl::Status st = be->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "cache slot out of range")) << st;
  EXPECT_TRUE(be->Synchronize().ok()) << "the error word is cleared once read";
}

TEST(DeviceBackend, KernelIndexChecksReachSynchronize) {
  // The staging adapter without its host-side id checks: bad ids reach the
  // kernels, which must record them in the error word for Synchronize.
  auto raw = RawDeviceBackend();
  if (raw == nullptr) GTEST_SKIP() << "no device backend in this build";
  StagingBackend::Options options;
  options.check_contents = false;
  StagingBackend be(std::move(raw), options);
  int checked = 0;
  if (be.Supports(Op::kEmbeddingGather)) {
    std::vector<uint16_t> table(40 * 8, F32ToBf16(1.0f));
    std::vector<float> out(2 * 8);
    for (std::vector<int32_t> ids : {std::vector<int32_t>{3, 40}, {-1, 0}}) {
      absl::Status st =
          be.EmbeddingGather(table.data(), 40, 8, ids.data(), 2, out.data());
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_TRUE(absl::StrContains(st.message(), "token id out of range")) << st;
    }
    ++checked;
  }
  if (be.Supports(Op::kPagedCacheWrite)) {
    std::vector<float> src(2 * 16, 1.0f);
    std::vector<uint16_t> cache(4 * 16);
    std::vector<int32_t> slots = {1, 4};
    absl::Status st =
        be.PagedCacheWrite(src.data(), 16, slots.data(), 2, 16, cache.data(), 4);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "cache slot out of range")) << st;
    ++checked;
  }
  if (be.Supports(Op::kMoeMxfp4)) {
    const int64_t n = 32;
    std::vector<uint8_t> packed(n * n / 2, 0x22), scale(n, 127);
    Mxfp4Expert ex = {packed.data(), scale.data(),  packed.data(),
                      scale.data(),  packed.data(), scale.data()};
    std::vector<float> z(n, 0.1f), out(n);
    int32_t id = 1;  // only expert 0 exists
    float wt = 1.0f;
    MoeArgs a;
    a.tokens = 1;
    a.hidden = n;
    a.inter = n;
    a.top_k = 1;
    a.num_experts = 1;
    a.experts = &ex;
    a.z = z.data();
    a.ld_z = n;
    a.ids = &id;
    a.weights = &wt;
    a.out = out.data();
    a.ld_out = n;
    absl::Status st = be.MoeMxfp4(a);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "expert id out of range")) << st;
    ++checked;
  }
  EXPECT_TRUE(be.Synchronize().ok());
  if (checked == 0) {
    GTEST_SKIP() << be.name()
                 << " supports none of EmbeddingGather, PagedCacheWrite, MoeMxfp4 yet";
  }
}

// A device backend on the host device that writes one element past the end of
// AddInPlace's output (every other op is unimplemented).
class SloppyBackend final : public Backend {
 public:
  absl::string_view name() const override { return "sloppy"; }
  Device& device() override { return *device_; }
  absl::Status AddInPlace(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
    y[n] = 0.0f;  // one past the end
    return absl::OkStatus();
  }
#define SLOPPY_UNIMPLEMENTED(...) \
  { return absl::UnimplementedError("sloppy"); }
  absl::Status GemmBf16(const float*, int64_t, const uint16_t*, int64_t, float*,
                        int64_t, int64_t, int64_t, int64_t, bool) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      GemmF32(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
              int64_t, int64_t, bool) override SLOPPY_UNIMPLEMENTED() absl::Status
      RmsNorm(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t,
              float) override SLOPPY_UNIMPLEMENTED() absl::Status
      L2NormHeads(const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                  float, float) override SLOPPY_UNIMPLEMENTED() absl::Status
      SituGlu(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
              int64_t, float, float) override SLOPPY_UNIMPLEMENTED() absl::Status
      MulSigmoid(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                 int64_t) override SLOPPY_UNIMPLEMENTED() absl::Status
      EmbeddingGatherRows(const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                          const int32_t*, int64_t, float*) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      CausalConv1dSilu(const float*, int64_t, const float*, int64_t, float*, float*,
                       int64_t, int64_t, int64_t) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      KdaGates(const float*, int64_t, const float*, const float*, const float*, int64_t,
               float, int64_t, int64_t, int64_t, float*, float*) override
      SLOPPY_UNIMPLEMENTED() absl::Status KdaRecurrent(const KdaArgs&) override
      SLOPPY_UNIMPLEMENTED() absl::Status KdaChunked(const KdaArgs&) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      KdaOutputGate(const float*, int64_t, const float*, const float*, int64_t, float*,
                    int64_t, int64_t, int64_t, int64_t, float) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      PagedCacheWrite(const float*, int64_t, const int32_t*, int64_t, int64_t,
                      uint16_t*, int64_t) override SLOPPY_UNIMPLEMENTED() absl::Status
      MlaAttentionExpanded(const MlaArgs&) override SLOPPY_UNIMPLEMENTED() absl::Status
      MlaAttentionAbsorbed(const MlaArgs&) override SLOPPY_UNIMPLEMENTED() absl::Status
      RouterTopK(const float*, int64_t, const uint16_t*, const float*, int64_t, int64_t,
                 int64_t, int64_t, bool, float, int32_t*, float*) override
      SLOPPY_UNIMPLEMENTED() absl::Status MoeMxfp4(const MoeArgs&) override
      SLOPPY_UNIMPLEMENTED() absl::Status
      AttnResMix(const float* const*, int64_t, const float*, const float*, const float*,
                 float, int64_t, int64_t, float*) override
      SLOPPY_UNIMPLEMENTED() absl::Status ChunkHashes(const ChunkHashArgs&) override
      SLOPPY_UNIMPLEMENTED()
#undef SLOPPY_UNIMPLEMENTED

          private : std::unique_ptr<Device> device_ = CreateHostDevice();
};

TEST(StagingBackend, GuardBytesCatchWritesPastAnOutput) {
  StagingBackend be(std::make_unique<SloppyBackend>());
  std::vector<float> y(10, 1.0f), x(10, 2.0f);
  absl::Status st = be.AddInPlace(y.data(), x.data(), 10);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "AddInPlace wrote outside its output y"))
      << st;
  EXPECT_EQ(be.GemmF32(x.data(), 1, x.data(), 1, y.data(), 1, 1, 1, 1, false).code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace tandem::kernels
