// The KDA kernels (kda.cu) on the SIMT emulator against the fp64 oracle
// (CreateReferenceBackend: the token recurrence in double). Under the emulator
// device memory is host memory, so the launchers run on host vectors.
//
// Bound (the CPU contract, kernels/README.md): max |got - want| <= 1e-4 * max|want|
// over the outputs and over the final state, for both forms.
#include "kernels/cuda/kda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

constexpr float kGuard = 12345.0f;  // padding of strided rows: must stay untouched

class SeedGuard {
 public:
  explicit SeedGuard(uint64_t seed) : saved_(cuda_sim::Seed()) {
    cuda_sim::SetSeed(seed);
  }
  ~SeedGuard() { cuda_sim::SetSeed(saved_); }

 private:
  uint64_t saved_;
};

struct Inputs {
  int64_t tokens, heads, dk, dv, ld_qk, ld_v, ld_out;
  std::vector<float> q, k, v, g, beta, state;
};

// q, k L2-normalised per head (q scaled by dk^-0.5), gates in (-5, 0): strong
// decays put ~4/5 of the channels near -5 per token, the rest near 0. Rows carry
// `pad` extra columns of guard values.
Inputs Make(uint32_t seed, int64_t tokens, int64_t heads, int64_t dk, int64_t dv,
            bool strong, int64_t pad = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  Inputs in{tokens,
            heads,
            dk,
            dv,
            heads * dk + pad,
            heads * dv + pad,
            heads * dv + pad,
            {},
            {},
            {},
            {},
            {},
            {}};
  in.q.assign(tokens * in.ld_qk, kGuard);
  in.k.assign(tokens * in.ld_qk, kGuard);
  in.v.assign(tokens * in.ld_v, kGuard);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* q = &in.q[t * in.ld_qk + h * dk];
      float* k = &in.k[t * in.ld_qk + h * dk];
      double nq = 0, nk = 0;
      for (int64_t c = 0; c < dk; ++c) {
        q[c] = n01(rng);
        k[c] = n01(rng);
        nq += q[c] * q[c];
        nk += k[c] * k[c];
      }
      const float sq = static_cast<float>(1.0 / std::sqrt(nq + 1e-6) / std::sqrt(dk));
      const float sk = static_cast<float>(1.0 / std::sqrt(nk + 1e-6));
      for (int64_t c = 0; c < dk; ++c) {
        q[c] *= sq;
        k[c] *= sk;
      }
      for (int64_t e = 0; e < dv; ++e) in.v[t * in.ld_v + h * dv + e] = n01(rng);
    }
  }
  in.g.resize(tokens * heads * dk);
  for (int64_t i = 0; i < tokens * heads * dk; ++i) {
    const float z = n01(rng) + (strong ? (i % 5 == 0 ? -6.0f : 6.0f) : 0.0f);
    in.g[i] = -5.0f / (1.0f + std::exp(-z));
  }
  in.beta.resize(tokens * heads);
  for (float& b : in.beta) b = 1.0f / (1.0f + std::exp(-n01(rng)));
  in.state.resize(heads * dk * dv);
  for (float& s : in.state) s = 0.3f * n01(rng);
  return in;
}

// Token range [t0, t0 + n) of `in` as launcher arguments on `state` and `out`
// (out holds all tokens: [tokens, ld_out]).
KdaLaunchArgs Launch(Inputs& in, int64_t t0, int64_t n, std::vector<float>& state,
                     std::vector<float>& out) {
  KdaLaunchArgs a;
  a.tokens = n;
  a.heads = in.heads;
  a.head_dim_k = in.dk;
  a.head_dim_v = in.dv;
  a.q = in.q.data() + t0 * in.ld_qk;
  a.k = in.k.data() + t0 * in.ld_qk;
  a.ld_qk = in.ld_qk;
  a.v = in.v.data() + t0 * in.ld_v;
  a.ld_v = in.ld_v;
  a.g = in.g.data() + t0 * in.heads * in.dk;
  a.beta = in.beta.data() + t0 * in.heads;
  a.state = state.data();
  a.out = out.data() + t0 * in.ld_out;
  a.ld_out = in.ld_out;
  return a;
}

KdaArgs Oracle(const KdaLaunchArgs& l) {
  KdaArgs a;
  a.tokens = l.tokens;
  a.heads = l.heads;
  a.head_dim_k = l.head_dim_k;
  a.head_dim_v = l.head_dim_v;
  a.q = l.q;
  a.k = l.k;
  a.ld_qk = l.ld_qk;
  a.v = l.v;
  a.ld_v = l.ld_v;
  a.g = l.g;
  a.beta = l.beta;
  a.state = l.state;
  a.out = l.out;
  a.ld_out = l.ld_out;
  return a;
}

struct Want {
  std::vector<float> out, state;
};
Want Reference(Inputs& in) {
  Want w{std::vector<float>(in.tokens * in.ld_out, kGuard), in.state};
  std::unique_ptr<Backend> ref = CreateReferenceBackend();
  EXPECT_TRUE(ref->KdaRecurrent(Oracle(Launch(in, 0, in.tokens, w.state, w.out))).ok());
  return w;
}

// max |got - want| / max |want| over the valid entries; guards must be intact.
double NormError(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double mx = 0, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == kGuard) {
      EXPECT_EQ(got[i], kGuard) << "guard overwritten at " << i;
      continue;
    }
    mx = std::max(mx, std::fabs(static_cast<double>(want[i])));
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    err = std::max(err, std::isfinite(d) ? d : 1e30);
  }
  return err / std::max(mx, 1e-20);
}

// kChunked chooses the state-pass tile; kChunked16 / kChunked32 force it.
enum class Form { kRecurrent, kChunked, kChunked16, kChunked32 };

void RunForm(Form form, Inputs& in, int64_t t0, int64_t n, std::vector<float>& state,
             std::vector<float>& out) {
  const KdaLaunchArgs a = Launch(in, t0, n, state, out);
  const char* err = nullptr;
  if (form == Form::kRecurrent) {
    err = KdaRecurrentLaunch(a, nullptr);
  } else {
    std::vector<float> scratch(
        KdaChunkedScratchBytes(n, in.heads, in.dk, in.dv) / sizeof(float) + 4);
    const int tile = form == Form::kChunked16 ? 16 : form == Form::kChunked32 ? 32 : 0;
    err = KdaChunkedLaunch(a, scratch.data(), nullptr, tile);
  }
  ASSERT_EQ(err, nullptr) << err;
}

struct Case {
  int64_t tokens, heads, dk, dv;
  bool strong;
  int64_t pad;
};

std::string Name(const Case& c) {
  return "T=" + std::to_string(c.tokens) + " h=" + std::to_string(c.heads) +
         " dk=" + std::to_string(c.dk) + " dv=" + std::to_string(c.dv) +
         (c.strong ? " strong" : " mild");
}

void CheckCase(Form form, const Case& c, uint32_t data_seed, uint64_t sim_seed) {
  SeedGuard guard(sim_seed);
  Inputs in = Make(data_seed, c.tokens, c.heads, c.dk, c.dv, c.strong, c.pad);
  const Want want = Reference(in);
  std::vector<float> state = in.state, out(in.tokens * in.ld_out, kGuard);
  // The padding columns of `out` are guards; so are those of want.out.
  RunForm(form, in, 0, c.tokens, state, out);
  const double eo = NormError(out, want.out), es = NormError(state, want.state);
  const char* fname = form == Form::kRecurrent   ? "recurrent"
                      : form == Form::kChunked16 ? "chunked16"
                      : form == Form::kChunked32 ? "chunked32"
                                                 : "chunked";
  std::printf("%-9s %-36s sim seed %llu: out err %.2e, state err %.2e\n", fname,
              Name(c).c_str(), static_cast<unsigned long long>(sim_seed), eo, es);
  EXPECT_LE(eo, 1e-4) << fname << " out " << Name(c);
  EXPECT_LE(es, 1e-4) << fname << " state " << Name(c);
}

TEST(KdaCuda, RecurrentMatchesTheOracle) {
  const Case cases[] = {
      {1, 1, 16, 16, true, 0},  {15, 2, 16, 32, true, 3}, {17, 3, 24, 40, false, 0},
      {64, 1, 32, 16, true, 0}, {2, 1, 200, 8, true, 1},  // d_k > 128: 32 warps
  };
  uint64_t sim_seed = 1;
  for (const Case& c : cases) CheckCase(Form::kRecurrent, c, 7, sim_seed++);
}

TEST(KdaCuda, ChunkedMatchesTheOracle) {
  // Partial, exact and multiple chunks of 16; odd head dims (padding to 16 / 32).
  const Case cases[] = {
      {1, 1, 16, 16, true, 0},   {15, 2, 16, 16, true, 2},  {16, 1, 32, 32, true, 0},
      {17, 3, 16, 32, false, 0}, {63, 1, 32, 16, true, 0},  {64, 2, 16, 16, true, 1},
      {65, 1, 24, 40, true, 0},  {130, 1, 32, 32, true, 0}, {33, 1, 70, 20, false, 0},
      {18, 1, 512, 8, true, 0},  {20, 1, 256, 8, true, 0},  // 8 and 4 m-tiles a warp
  };
  uint64_t sim_seed = 11;
  for (const Case& c : cases) {
    if (c.dk <= 256) CheckCase(Form::kChunked16, c, 9, sim_seed++);
    CheckCase(Form::kChunked32, c, 9, sim_seed++);
  }
}

TEST(KdaCuda, K3ShapesAtOneAndTwoTokens) {
  // K3 at TP8: 12 KDA heads per rank, d_k = d_v = 128.
  for (int64_t tokens : {1, 2}) {
    const Case c{tokens, 12, 128, 128, true, 0};
    CheckCase(Form::kRecurrent, c, 21, 3);
    CheckCase(Form::kChunked, c, 21, 4);    // 16-column state tiles: 96 blocks
    CheckCase(Form::kChunked32, c, 21, 5);  // 48 blocks
  }
}

TEST(KdaCuda, ChunkedHeadDim128OverSeveralChunks) {
  CheckCase(Form::kChunked, Case{40, 1, 128, 128, true, 0}, 5, 6);
  // The conformance suite's long case, and a long mild one (slow decays keep the
  // state's memory long: the error can accumulate over chunks).
  CheckCase(Form::kChunked, Case{200, 1, 128, 64, true, 0}, 6, 7);
  CheckCase(Form::kChunked, Case{400, 1, 128, 32, false, 0}, 8, 8);
}

TEST(KdaCuda, RaceFreeUnderSeveralSchedules) {
  for (uint64_t s : {0, 2, 3, 5}) {
    CheckCase(Form::kRecurrent, Case{5, 2, 32, 40, true, 0}, 13, s);
    CheckCase(Form::kChunked16, Case{33, 2, 32, 40, true, 0}, 13, s);
    CheckCase(Form::kChunked32, Case{33, 2, 32, 40, true, 0}, 13, s);
  }
}

TEST(KdaCuda, ZeroTokensIsANoOp) {
  Inputs in = Make(3, 1, 2, 16, 16, true);
  for (Form form : {Form::kRecurrent, Form::kChunked}) {
    std::vector<float> state = in.state, out(in.ld_out, kGuard);
    RunForm(form, in, 0, 0, state, out);
    EXPECT_EQ(state, in.state);
    for (float o : out) EXPECT_EQ(o, kGuard);
  }
  EXPECT_EQ(KdaChunkedScratchBytes(0, 2, 16, 16), 0u);
}

TEST(KdaCuda, ChunkedPrefillThenRecurrentDecodeEqualsOneRecurrence) {
  // Chunked over 37 tokens (two full chunks and a partial one), then 3 decode steps
  // and one chunked call of 2 tokens, all from the carried state.
  Inputs in = Make(17, 42, 2, 32, 32, true);
  const Want want = Reference(in);
  std::vector<float> state = in.state, out(in.tokens * in.ld_out, kGuard);
  RunForm(Form::kChunked, in, 0, 37, state, out);
  for (int64_t t = 37; t < 40; ++t) RunForm(Form::kRecurrent, in, t, 1, state, out);
  RunForm(Form::kChunked, in, 40, 2, state, out);
  EXPECT_LE(NormError(out, want.out), 1e-4);
  EXPECT_LE(NormError(state, want.state), 1e-4);
}

TEST(KdaCuda, ChunkedInScratchSizedSegmentsEqualsOneRecurrence) {
  // What GpuBackend::KdaChunked does for long prompts: segments of
  // KdaChunkedTokensFor(budget) tokens, the state carried between launches.
  EXPECT_EQ(KdaChunkedTokensFor(0, 12, 128, 128), 16);
  EXPECT_EQ(KdaChunkedTokensFor(size_t{64} << 20, 12, 128, 128), 2608);
  Inputs in = Make(29, 75, 2, 32, 16, true);
  const Want want = Reference(in);
  const int64_t seg =
      KdaChunkedTokensFor(2 * KdaChunkedScratchBytes(16, in.heads, in.dk, in.dv) + 100,
                          in.heads, in.dk, in.dv);
  ASSERT_EQ(seg, 32);
  std::vector<float> state = in.state, out(in.tokens * in.ld_out, kGuard);
  for (int64_t t0 = 0; t0 < in.tokens; t0 += seg) {
    RunForm(Form::kChunked, in, t0, std::min(seg, in.tokens - t0), state, out);
  }
  EXPECT_LE(NormError(out, want.out), 1e-4);
  EXPECT_LE(NormError(state, want.state), 1e-4);
}

TEST(KdaCuda, ChunkedEqualsRecurrent) {
  Inputs in = Make(23, 50, 2, 48, 24, true);
  std::vector<float> s_rec = in.state, o_rec(in.tokens * in.ld_out, kGuard);
  std::vector<float> s_ch = in.state, o_ch(in.tokens * in.ld_out, kGuard);
  RunForm(Form::kRecurrent, in, 0, in.tokens, s_rec, o_rec);
  RunForm(Form::kChunked, in, 0, in.tokens, s_ch, o_ch);
  EXPECT_LE(NormError(o_ch, o_rec), 1e-4);
  EXPECT_LE(NormError(s_ch, s_rec), 1e-4);
}

TEST(KdaCuda, BadStateTileIsAnError) {
  Inputs in = Make(3, 1, 1, 272, 8, true);
  std::vector<float> state = in.state, out(in.ld_out, kGuard);
  std::vector<float> scratch(KdaChunkedScratchBytes(1, 1, 272, 8) / sizeof(float));
  const KdaLaunchArgs a = Launch(in, 0, 1, state, out);
  EXPECT_NE(KdaChunkedLaunch(a, scratch.data(), nullptr, 24), nullptr);
  EXPECT_NE(KdaChunkedLaunch(a, scratch.data(), nullptr, 16), nullptr);  // d_k > 256
  EXPECT_EQ(KdaChunkedLaunch(a, scratch.data(), nullptr, 0), nullptr);
}

TEST(KdaCuda, HeadDimKAboveTheLimitIsAnError) {
  KdaLaunchArgs a;
  a.tokens = 1;
  a.heads = 1;
  a.head_dim_k = kKdaMaxHeadDimK + 1;
  a.head_dim_v = 1;
  EXPECT_NE(KdaRecurrentLaunch(a, nullptr), nullptr);
  EXPECT_NE(KdaChunkedLaunch(a, nullptr, nullptr), nullptr);
}

}  // namespace
}  // namespace tandem::kernels::cuda
