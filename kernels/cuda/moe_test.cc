// The moe kernels (moe.cu) on the SIMT emulator, launchers called directly on host
// vectors (device memory is host memory under cuda_sim), against the fp64 oracle
// (CreateReferenceBackend). Router: ids exact, weights 1e-5 * (1 + |want|).
// MoeMxfp4: the BF16 tensor-core bound of moe.h, |err| <= 1e-2 * max|want|. Every
// case runs under several scheduling seeds and must give bit-identical results.
#include "kernels/cuda/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/sim/simt.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {
namespace {

constexpr uint64_t kSeeds[] = {1, 7, 12345};

class SeedGuard {
 public:
  SeedGuard() : saved_(cuda_sim::Seed()) {}
  ~SeedGuard() { cuda_sim::SetSeed(saved_); }

 private:
  uint64_t saved_;
};

// 256-byte aligned device scratch (host memory under the emulator), poisoned.
class ScratchBuffer {
 public:
  explicit ScratchBuffer(size_t bytes) : raw_(bytes + 512, 0xA5) {}
  void* get() {
    const uintptr_t p = reinterpret_cast<uintptr_t>(raw_.data());
    return reinterpret_cast<void*>((p + 255) / 256 * 256);
  }

 private:
  std::vector<unsigned char> raw_;
};

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ============================ RouterTopK ======================================

struct RouterCase {
  int64_t tokens, hidden, experts, top_k;
  bool renormalize;
  float scaling;
};

struct RouterResult {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

RouterResult RunRouter(const RouterCase& c, const std::vector<float>& x, int64_t ldx,
                       const std::vector<uint16_t>& gate,
                       const std::vector<float>& bias,
                       const uint16_t* gate_ptr = nullptr) {
  RouterResult r;
  r.ids.assign(c.tokens * c.top_k, -7);
  r.weights.assign(c.tokens * c.top_k, -7.0f);
  ScratchBuffer scratch(RouterScratchBytes(c.tokens, c.experts));
  const char* err = LaunchRouterTopK(
      x.data(), ldx, gate_ptr != nullptr ? gate_ptr : gate.data(), bias.data(),
      c.tokens, c.hidden, c.experts, c.top_k, c.renormalize, c.scaling, r.ids.data(),
      r.weights.data(), scratch.get(), nullptr);
  EXPECT_EQ(err, nullptr) << (err ? err : "");
  return r;
}

RouterResult RunRouterReference(const RouterCase& c, const std::vector<float>& x,
                                int64_t ldx, const std::vector<uint16_t>& gate,
                                const std::vector<float>& bias) {
  RouterResult r;
  r.ids.assign(c.tokens * c.top_k, -7);
  r.weights.assign(c.tokens * c.top_k, -7.0f);
  auto ref = CreateReferenceBackend();
  EXPECT_TRUE(ref->RouterTopK(x.data(), ldx, gate.data(), bias.data(), c.tokens,
                              c.hidden, c.experts, c.top_k, c.renormalize, c.scaling,
                              r.ids.data(), r.weights.data())
                  .ok());
  return r;
}

void ExpectRouterMatches(const RouterCase& c, const std::vector<float>& x, int64_t ldx,
                         const std::vector<uint16_t>& gate,
                         const std::vector<float>& bias, const std::string& what) {
  SeedGuard guard;
  const RouterResult want = RunRouterReference(c, x, ldx, gate, bias);
  RouterResult first;
  for (uint64_t seed : kSeeds) {
    cuda_sim::SetSeed(seed);
    const RouterResult got = RunRouter(c, x, ldx, gate, bias);
    ASSERT_EQ(got.ids, want.ids) << what << " seed " << seed;
    for (size_t i = 0; i < want.weights.size(); ++i) {
      ASSERT_NEAR(got.weights[i], want.weights[i],
                  1e-5 * (1 + std::fabs(want.weights[i])))
          << what << " seed " << seed << " i " << i;
    }
    if (seed == kSeeds[0]) {
      first = got;
    } else {
      EXPECT_EQ(got.ids, first.ids) << what;
      EXPECT_EQ(0, std::memcmp(got.weights.data(), first.weights.data(),
                               got.weights.size() * sizeof(float)))
          << what << ": not deterministic across seeds";
    }
  }
}

struct RouterInputs {
  std::vector<float> x;
  std::vector<uint16_t> gate;
  std::vector<float> bias;
};

RouterInputs RandomRouterInputs(std::mt19937& rng, const RouterCase& c, int64_t ldx) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  RouterInputs in;
  in.x.resize(c.tokens * ldx);
  for (float& v : in.x) v = nd(rng);
  in.gate.resize(c.experts * c.hidden);
  const float gs = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  for (uint16_t& v : in.gate) v = ToBf16(nd(rng) * gs);
  in.bias.resize(c.experts);
  for (float& v : in.bias) v = 0.05f * nd(rng);
  return in;
}

TEST(RouterTopKTest, MatchesOracleSmall) {
  std::mt19937 rng(11);
  // GEMV kernel: hidden % 8 != 0 takes the scalar gate loads, else 16-byte loads;
  // 1100 = 32 ranges of 64 (two staged chunks each), the last ones partial/empty.
  for (const RouterCase& c :
       {RouterCase{9, 199, 37, 6, true, 2.5f}, RouterCase{9, 200, 37, 6, false, 2.5f},
        RouterCase{20, 256, 37, 6, true, 1.0f},
        RouterCase{1, 64, 8, 8, true, 1.0f},  // top_k = E
        RouterCase{3, 1100, 40, 1, false, 0.5f}}) {
    const int64_t ldx = c.hidden + 3;
    const RouterInputs in = RandomRouterInputs(rng, c, ldx);
    ExpectRouterMatches(
        c, in.x, ldx, in.gate, in.bias,
        "tokens " + std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden));
  }
}

TEST(RouterTopKTest, TiledPathMatchesOracle) {
  // >= 65 tokens: the 64 x 64 tiled logits kernel (token and expert tails).
  std::mt19937 rng(12);
  for (const RouterCase& c : {RouterCase{70, 200, 37, 6, true, 2.5f},
                              RouterCase{130, 256, 100, 8, false, 1.0f}}) {
    const int64_t ldx = c.hidden + 1;
    const RouterInputs in = RandomRouterInputs(rng, c, ldx);
    ExpectRouterMatches(c, in.x, ldx, in.gate, in.bias,
                        "tiled tokens " + std::to_string(c.tokens));
  }
}

TEST(RouterTopKTest, BatchInvariant) {
  // A token's ids and weights are bit for bit the same alone (GEMV kernel), in a
  // batch of 9 (two GEMV token tiles) and in a batch of 70 (tiled kernel).
  std::mt19937 rng(13);
  const RouterCase big{70, 320, 48, 5, true, 1.5f};
  const RouterInputs in = RandomRouterInputs(rng, big, big.hidden);
  const RouterResult all = RunRouter(big, in.x, big.hidden, in.gate, in.bias);
  RouterCase nine = big;
  nine.tokens = 9;
  const RouterResult first9 = RunRouter(nine, in.x, big.hidden, in.gate, in.bias);
  for (int64_t t : {0, 3, 8, 40, 69}) {
    RouterCase one = big;
    one.tokens = 1;
    const std::vector<float> xt(in.x.begin() + t * big.hidden,
                                in.x.begin() + (t + 1) * big.hidden);
    const RouterResult r = RunRouter(one, xt, big.hidden, in.gate, in.bias);
    for (int64_t i = 0; i < big.top_k; ++i) {
      EXPECT_EQ(r.ids[i], all.ids[t * big.top_k + i]) << t;
      EXPECT_EQ(r.weights[i], all.weights[t * big.top_k + i]) << t;
      if (t < 9) {
        EXPECT_EQ(r.ids[i], first9.ids[t * big.top_k + i]) << t;
        EXPECT_EQ(r.weights[i], first9.weights[t * big.top_k + i]) << t;
      }
    }
  }
}

TEST(RouterTopKTest, K3ShapeMatchesOracle) {
  // 896 experts, top 16, the full 7168 hidden, 1 and 2 tokens (decode).
  std::mt19937 rng(5);
  for (int64_t tokens : {1, 2}) {
    const RouterCase c{tokens, 7168, 896, 16, true, 2.827f};
    const RouterInputs in = RandomRouterInputs(rng, c, c.hidden);
    ExpectRouterMatches(c, in.x, c.hidden, in.gate, in.bias,
                        "K3 tokens " + std::to_string(tokens));
    const RouterResult got = RunRouter(c, in.x, c.hidden, in.gate, in.bias);
    for (int64_t t = 0; t < tokens; ++t) {
      double sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += got.weights[t * 16 + i];
      EXPECT_NEAR(sum, 2.827, 1e-5);
    }
  }
}

TEST(RouterTopKTest, TiesGoToTheLowerExpertId) {
  const int64_t hidden = 64, experts = 37;
  std::mt19937 rng(3);
  RouterCase c{1, hidden, experts, 4, true, 1.0f};
  RouterInputs in = RandomRouterInputs(rng, c, hidden);
  // x = 0: every s = 0.5; the bias breaks ties only through the key.
  std::vector<float> zero(hidden, 0.0f), tie_bias(experts, 0.0f);
  tie_bias[30] = 0.25f;
  const RouterResult r = RunRouter(c, zero, hidden, in.gate, tie_bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{30, 0, 1, 2}));
  for (float v : r.weights) EXPECT_NEAR(v, 0.25f, 1e-6f);
  // Identical gate rows (experts 5, 9, 21 = row 21) give identical logits: the
  // chosen order among them is by id. Bias pushes them to the top.
  std::vector<float> bias(experts, 0.0f);
  for (int64_t e : {5, 9, 21}) {
    std::copy(in.gate.begin() + 21 * hidden, in.gate.begin() + 22 * hidden,
              in.gate.begin() + e * hidden);
    bias[e] = 10.0f;
  }
  const RouterResult d = RunRouter(c, in.x, hidden, in.gate, bias);
  EXPECT_EQ(d.ids[0], 5);
  EXPECT_EQ(d.ids[1], 9);
  EXPECT_EQ(d.ids[2], 21);
  EXPECT_EQ(d.weights[0], d.weights[1]);
  EXPECT_EQ(d.weights[1], d.weights[2]);
  const RouterResult want = RunRouterReference(c, in.x, hidden, in.gate, bias);
  EXPECT_EQ(d.ids, want.ids);
}

TEST(RouterTopKTest, UnalignedGateTakesTheScalarPath) {
  std::mt19937 rng(9);
  const RouterCase c{5, 128, 24, 3, true, 1.0f};
  const RouterInputs in = RandomRouterInputs(rng, c, c.hidden);
  std::vector<uint16_t> shifted(in.gate.size() + 1);
  std::copy(in.gate.begin(), in.gate.end(), shifted.begin() + 1);  // 2-byte aligned
  const RouterResult want = RunRouterReference(c, in.x, c.hidden, in.gate, in.bias);
  const RouterResult got =
      RunRouter(c, in.x, c.hidden, in.gate, in.bias, shifted.data() + 1);
  EXPECT_EQ(got.ids, want.ids);
  for (size_t i = 0; i < want.weights.size(); ++i) {
    EXPECT_NEAR(got.weights[i], want.weights[i],
                1e-5 * (1 + std::fabs(want.weights[i])));
  }
}

// ============================== MoeMxfp4 ======================================

struct Expert {
  std::vector<uint8_t> packed[3], scale[3];  // w1, w3, w2
};

Expert RandomExpert(std::mt19937& rng, int64_t hidden, int64_t inter, int lo = 120,
                    int hi = 124) {
  Expert w;
  const int64_t rows[3] = {inter, inter, hidden}, cols[3] = {hidden, hidden, inter};
  std::uniform_int_distribution<int> byte(0, 255), sc(lo, hi);
  for (int i = 0; i < 3; ++i) {
    w.packed[i].resize(rows[i] * cols[i] / 2);
    w.scale[i].resize(rows[i] * cols[i] / 32);
    for (uint8_t& b : w.packed[i]) b = static_cast<uint8_t>(byte(rng));
    for (uint8_t& b : w.scale[i]) b = static_cast<uint8_t>(sc(rng));
  }
  return w;
}

struct MoeCase {
  int64_t tokens, hidden, inter, top_k, num_experts;
  std::vector<Expert> store;
  std::vector<Mxfp4Expert> experts;  // null entries: owned by another rank
  std::vector<float> z;
  int64_t ld_z = 0, ld_out = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;

  MoeArgs Args(float* out) const {
    MoeArgs a;
    a.tokens = tokens;
    a.hidden = hidden;
    a.inter = inter;
    a.top_k = top_k;
    a.num_experts = num_experts;
    a.experts = experts.data();
    a.z = z.data();
    a.ld_z = ld_z;
    a.ids = ids.data();
    a.weights = weights.data();
    a.out = out;
    a.ld_out = ld_out;
    return a;
  }
};

void Wire(MoeCase& c, const std::vector<int>& remote) {
  c.experts.assign(c.num_experts, Mxfp4Expert{});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (std::find(remote.begin(), remote.end(), e) != remote.end()) continue;
    Expert& s = c.store[e];
    c.experts[e] = {s.packed[0].data(), s.scale[0].data(),  s.packed[1].data(),
                    s.scale[1].data(),  s.packed[2].data(), s.scale[2].data()};
  }
}

// Random case: each token routed to top_k distinct experts, some slots -1, the
// experts in `remote` null.
MoeCase RandomMoe(std::mt19937& rng, int64_t tokens, int64_t hidden, int64_t inter,
                  int64_t top_k, int64_t num_experts, const std::vector<int>& remote,
                  bool with_padding) {
  MoeCase c{tokens, hidden, inter, top_k, num_experts};
  for (int64_t e = 0; e < num_experts; ++e)
    c.store.push_back(RandomExpert(rng, hidden, inter));
  Wire(c, remote);
  c.ld_z = hidden + 5;
  c.ld_out = hidden + 3;
  std::normal_distribution<float> nd(0.0f, 0.5f);
  c.z.resize(tokens * c.ld_z);
  for (float& v : c.z) v = nd(rng);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  std::vector<int32_t> perm(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = 0; i < top_k; ++i) {
      c.ids.push_back(perm[i]);
      c.weights.push_back(wd(rng));
    }
  }
  if (with_padding) {
    for (int64_t t = 0; t < tokens; t += 3) c.ids[t * top_k + (t % top_k)] = -1;
  }
  return c;
}

std::vector<float> RunMoe(const MoeCase& c, int32_t* error_word = nullptr,
                          int tile_n = 0, bool allow_gemv = true, bool split = false) {
  std::vector<float> out(std::max<int64_t>(c.tokens, 1) * c.ld_out, 123.0f);
  MoeArgs a = c.Args(out.data());
  MoeLaunchArgs l;
  l.tokens = a.tokens;
  l.hidden = a.hidden;
  l.inter = a.inter;
  l.top_k = a.top_k;
  l.num_experts = a.num_experts;
  l.experts = reinterpret_cast<const MoeExpertPtrs*>(a.experts);
  l.z = a.z;
  l.ld_z = a.ld_z;
  l.ids = a.ids;
  l.weights = a.weights;
  l.situ_beta = a.situ_beta;
  l.situ_linear_beta = a.situ_linear_beta;
  l.out = a.out;
  l.ld_out = a.ld_out;
  l.tile_n = tile_n;
  l.allow_gemv = allow_gemv;
  l.split_bf16 = split;
  ScratchBuffer scratch(
      MoeScratchBytes(c.tokens, c.hidden, c.inter, c.top_k, c.num_experts, split));
  int32_t local_error = 0;
  const char* err =
      LaunchMoeMxfp4(l, scratch.get(), error_word ? error_word : &local_error, nullptr);
  EXPECT_EQ(err, nullptr) << (err ? err : "");
  if (error_word == nullptr) {
    EXPECT_EQ(local_error, 0) << DeviceErrorName(local_error);
  }
  return out;
}

std::vector<float> RunMoeReference(const MoeCase& c) {
  std::vector<float> out(std::max<int64_t>(c.tokens, 1) * c.ld_out, 123.0f);
  auto ref = CreateReferenceBackend();
  EXPECT_TRUE(ref->MoeMxfp4(c.Args(out.data())).ok());
  return out;
}

// Compares the hidden columns of every token; returns max|err| / max|want|.
double ExpectMoeClose(const MoeCase& c, const std::vector<float>& got,
                      const std::vector<float>& want, const std::string& what) {
  double max_want = 0, max_err = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.hidden; ++i) {
      max_want =
          std::max(max_want, std::fabs(static_cast<double>(want[t * c.ld_out + i])));
    }
  }
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.hidden; ++i) {
      const double e = std::fabs(static_cast<double>(got[t * c.ld_out + i]) -
                                 want[t * c.ld_out + i]);
      max_err = std::max(max_err, std::isnan(e) ? INFINITY : e);
    }
  }
  EXPECT_LE(max_err, 1e-2 * max_want) << what << " (max|want| " << max_want << ")";
  // The padding columns past hidden are not written.
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = c.hidden; i < c.ld_out; ++i) {
      EXPECT_EQ(got[t * c.ld_out + i], 123.0f) << what << " wrote past hidden";
    }
  }
  return max_want > 0 ? max_err / max_want : max_err;
}

float RoundBf16(float f) {
  const uint32_t u = static_cast<uint32_t>(ToBf16(f)) << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

std::vector<double> Dequant(const uint8_t* packed, const uint8_t* scale, int64_t rows,
                            int64_t cols) {
  std::vector<double> w(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t b = packed[r * (cols / 2) + c / 2];
      w[r * cols + c] = static_cast<double>(kE2m1Values[c % 2 ? b >> 4 : b & 0xf]) *
                        E8m0ToF32(scale[r * (cols / 32) + c / 32]);
    }
  }
  return w;
}

// What the kernels compute, in fp64: z and the SiTU activation rounded to BF16,
// exact products. Separates "the intended BF16 numerics" from "a wrong kernel".
std::vector<double> RunMoeBf16Model(const MoeCase& c) {
  std::vector<double> out(c.tokens * c.hidden, 0.0);
  std::vector<std::vector<std::vector<double>>> dq(c.num_experts);  // w1, w3, w2
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t k = 0; k < c.top_k; ++k) {
      const int32_t e = c.ids[t * c.top_k + k];
      if (e < 0 || e >= c.num_experts || c.experts[e].w1_packed == nullptr) continue;
      const Mxfp4Expert& x = c.experts[e];
      if (dq[e].empty()) {
        dq[e].push_back(Dequant(x.w1_packed, x.w1_scale, c.inter, c.hidden));
        dq[e].push_back(Dequant(x.w3_packed, x.w3_scale, c.inter, c.hidden));
        dq[e].push_back(Dequant(x.w2_packed, x.w2_scale, c.hidden, c.inter));
      }
      const auto& w1 = dq[e][0];
      const auto& w3 = dq[e][1];
      const auto& w2 = dq[e][2];
      std::vector<double> act(c.inter);
      for (int64_t r = 0; r < c.inter; ++r) {
        double h1 = 0, h3 = 0;
        for (int64_t i = 0; i < c.hidden; ++i) {
          const double zb = RoundBf16(c.z[t * c.ld_z + i]);
          h1 += w1[r * c.hidden + i] * zb;
          h3 += w3[r * c.hidden + i] * zb;
        }
        const double g = 4 * std::tanh(h1 / 4) / (1 + std::exp(-h1));
        act[r] = RoundBf16(static_cast<float>(g * 25 * std::tanh(h3 / 25)));
      }
      for (int64_t r = 0; r < c.hidden; ++r) {
        double y = 0;
        for (int64_t i = 0; i < c.inter; ++i) y += w2[r * c.inter + i] * act[i];
        out[t * c.hidden + r] += c.weights[t * c.top_k + k] * y;
      }
    }
  }
  return out;
}

// Reference comparison under every seed, both tile sizes (32, 64 pairs) and
// with / without the GEMV path, bit-identical across all (same k order); and against
// the BF16 model, 20x tighter than the bound (fp32 vs fp64 accumulation; a rare
// BF16 rounding of one activation may flip).
double ExpectMoeMatches(const MoeCase& c, const std::string& what) {
  SeedGuard guard;
  const std::vector<float> want = RunMoeReference(c);
  const std::vector<double> model = RunMoeBf16Model(c);
  double max_want = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.hidden; ++i) {
      max_want =
          std::max(max_want, std::fabs(static_cast<double>(want[t * c.ld_out + i])));
    }
  }
  std::vector<float> first;
  double worst = 0, worst_model = 0;
  // Each seed with another (tile, GEMV path) combination, all four covered.
  struct Config {
    uint64_t seed;
    int tile_n;
    bool gemv;
  };
  const Config configs[] = {{kSeeds[0], 32, true},
                            {kSeeds[1], 64, false},
                            {kSeeds[2], 64, true},
                            {kSeeds[0], 32, false}};
  for (const Config& cfg : configs) {
    {
      cuda_sim::SetSeed(cfg.seed);
      const std::vector<float> got = RunMoe(c, nullptr, cfg.tile_n, cfg.gemv);
      worst =
          std::max(worst, ExpectMoeClose(c, got, want,
                                         what + " seed " + std::to_string(cfg.seed) +
                                             " tile " + std::to_string(cfg.tile_n) +
                                             (cfg.gemv ? " gemv" : "")));
      double model_err = 0;
      for (int64_t t = 0; t < c.tokens; ++t) {
        for (int64_t i = 0; i < c.hidden; ++i) {
          model_err = std::max(
              model_err, std::fabs(got[t * c.ld_out + i] - model[t * c.hidden + i]));
        }
      }
      EXPECT_LE(model_err, 5e-4 * max_want) << what << ": differs from the BF16 model";
      worst_model = std::max(worst_model, max_want > 0 ? model_err / max_want : 0.0);
      if (first.empty()) {
        first = got;
      } else {
        EXPECT_EQ(0, std::memcmp(got.data(), first.data(), got.size() * sizeof(float)))
            << what << ": not the same bits across seeds, tiles and paths";
      }
    }
  }
  std::printf("%s: max|err| / max|want| vs oracle %.3g, vs BF16 model %.3g\n",
              what.c_str(), worst, worst_model);
  return worst;
}

// Exact mode (split-BF16 activations): within 2e-5 of max|want| of the fp32
// oracle (the BF16 path's ~3e-3 is the rounding of z and the activations),
// bit-identical across seeds, tiles and the GEMV path.
double ExpectSplitMatches(const MoeCase& c, const std::string& what) {
  SeedGuard guard;
  const std::vector<float> want = RunMoeReference(c);
  double max_want = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.hidden; ++i) {
      max_want =
          std::max(max_want, std::fabs(static_cast<double>(want[t * c.ld_out + i])));
    }
  }
  struct Config {
    uint64_t seed;
    int tile_n;
    bool gemv;
  };
  const Config configs[] = {{kSeeds[0], 32, true},
                            {kSeeds[1], 64, false},
                            {kSeeds[2], 64, true},
                            {kSeeds[0], 32, false}};
  std::vector<float> first;
  double worst = 0;
  for (const Config& cfg : configs) {
    cuda_sim::SetSeed(cfg.seed);
    const std::vector<float> got = RunMoe(c, nullptr, cfg.tile_n, cfg.gemv, true);
    double err = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int64_t i = 0; i < c.hidden; ++i) {
        const double e = std::fabs(static_cast<double>(got[t * c.ld_out + i]) -
                                   want[t * c.ld_out + i]);
        err = std::max(err, std::isnan(e) ? INFINITY : e);
      }
      for (int64_t i = c.hidden; i < c.ld_out; ++i) {
        EXPECT_EQ(got[t * c.ld_out + i], 123.0f) << what << " wrote past hidden";
      }
    }
    EXPECT_LE(err, 2e-5 * max_want)
        << what << " tile " << cfg.tile_n << (cfg.gemv ? " gemv" : "");
    worst = std::max(worst, max_want > 0 ? err / max_want : 0.0);
    if (first.empty()) {
      first = got;
    } else {
      EXPECT_EQ(0, std::memcmp(got.data(), first.data(), got.size() * sizeof(float)))
          << what << ": split mode not the same bits across seeds, tiles and paths";
    }
  }
  return worst;
}

TEST(MoeMxfp4Test, SplitBf16ModeMeetsTheFp32Bound) {
  std::mt19937 rng(31);
  double worst = 0;
  for (int64_t top_k : {2, 4}) {
    for (int64_t tokens : {1, 7, 40}) {
      const MoeCase c = RandomMoe(rng, tokens, 64, 32, top_k, 8, {2, 5}, tokens > 1);
      worst = std::max(worst,
                       ExpectSplitMatches(c, "split top " + std::to_string(top_k) +
                                                 " tokens " + std::to_string(tokens)));
    }
  }
  // Two shared-memory stages and K tails, one expert with 40 pairs (two n-tiles).
  MoeCase c = RandomMoe(rng, 40, 640, 160, 3, 6, {4}, false);
  for (int64_t t = 0; t < c.tokens; ++t) c.ids[t * 3 + 1] = 1;
  worst = std::max(worst, ExpectSplitMatches(c, "split stages"));
  std::printf("split-BF16 mode: max|err| / max|want| = %.3g\n", worst);
}

TEST(MoeMxfp4Test, MatchesOracleSmallShapes) {
  // hidden 64, inter 32, 8 experts, top 2..4, 1..40 tokens; padding ids and two
  // experts owned by another rank.
  std::mt19937 rng(21);
  double worst = 0;
  for (int64_t top_k : {2, 3, 4}) {
    for (int64_t tokens : {1, 2, 7, 40}) {
      const MoeCase c = RandomMoe(rng, tokens, 64, 32, top_k, 8, {2, 5}, tokens > 1);
      worst =
          std::max(worst, ExpectMoeMatches(c, "top " + std::to_string(top_k) +
                                                  " tokens " + std::to_string(tokens)));
    }
  }
  std::printf("small shapes: max|err| / max|want| = %.3g\n", worst);
}

TEST(MoeMxfp4Test, MatchesOracleTilesStagesAndTails) {
  // hidden 640 (two shared-memory stages, a 128-chunk tail), inter 160 (K tail of
  // one 32-group in the down GEMM, a 64-row block tail); one expert takes every
  // token (40 pairs: two n-tiles of 32).
  std::mt19937 rng(22);
  MoeCase c = RandomMoe(rng, 40, 640, 160, 3, 6, {4}, false);
  for (int64_t t = 0; t < c.tokens; ++t) {
    if (c.ids[t * 3] != 1 && c.ids[t * 3 + 1] != 1 && c.ids[t * 3 + 2] != 1) {
      c.ids[t * 3 + 1] = 1;
    }
  }
  const double worst = ExpectMoeMatches(c, "hidden 640 inter 160");
  std::printf("tiles/stages/tails: max|err| / max|want| = %.3g\n", worst);
}

TEST(MoeMxfp4Test, GemvPathOverLongK) {
  // Decode-sized groups (<= 8 pairs per expert: the GEMV path) over K > 512, so
  // the weight ring refills across groups: hidden 1152 = 2 * 512 + 128, inter
  // 544 = 512 + 32 (a lane-level tail).
  std::mt19937 rng(28);
  const MoeCase c = RandomMoe(rng, 3, 1152, 544, 2, 4, {1}, false);
  ExpectMoeMatches(c, "gemv long K");
}

TEST(MoeMxfp4Test, UnalignedWeightsAndOddScales) {
  // Packed rows starting off a 16-byte boundary (bytewise loads) and E8M0 scales
  // outside the integer-decode range (0, 1: through fp32).
  std::mt19937 rng(23);
  MoeCase c = RandomMoe(rng, 5, 64, 64, 2, 3, {}, false);
  std::vector<std::vector<uint8_t>> shifted;
  for (int64_t e = 0; e < 3; ++e) {
    for (int i = 0; i < 3; ++i) {
      std::vector<uint8_t>& p = c.store[e].packed[i];
      p.insert(p.begin(), 0x00);  // data now at offset 1
      for (size_t j = 0; j < c.store[e].scale[i].size(); j += 7) {
        c.store[e].scale[i][j] = static_cast<uint8_t>(j % 2);
      }
    }
  }
  Wire(c, {});
  for (int64_t e = 0; e < 3; ++e) {
    c.experts[e].w1_packed += 1;
    c.experts[e].w3_packed += 1;
    c.experts[e].w2_packed += 1;
  }
  ExpectMoeMatches(c, "unaligned");
}

TEST(MoeMxfp4Test, BatchInvariant) {
  // A token's output is bit for bit the same alone and inside a batch of 40 (its
  // columns of every tile depend only on its own pairs; fixed k and slot order).
  std::mt19937 rng(27);
  const MoeCase all = RandomMoe(rng, 40, 64, 96, 3, 6, {2}, true);
  const std::vector<float> got = RunMoe(all);
  for (int64_t t : {0, 1, 17, 39}) {
    MoeCase one = all;
    one.tokens = 1;
    one.z.assign(all.z.begin() + t * all.ld_z, all.z.begin() + (t + 1) * all.ld_z);
    one.ids.assign(all.ids.begin() + t * 3, all.ids.begin() + (t + 1) * 3);
    one.weights.assign(all.weights.begin() + t * 3, all.weights.begin() + (t + 1) * 3);
    Wire(one, {2});  // the copied pointers still point into `all`; rewire to one's
    const std::vector<float> alone = RunMoe(one);
    EXPECT_EQ(0, std::memcmp(alone.data(), got.data() + t * all.ld_out,
                             all.hidden * sizeof(float)))
        << "token " << t;
  }
}

TEST(MoeMxfp4Test, KnownValues) {
  // One expert, hidden = inter = 32: w1 = w3 = all code 2 (1.0) at scale 2^1, w2 =
  // code 9 (-0.5) at scale 2^0. z = 2^-7 (exact in BF16): h = 2 * 32 * 2^-7 = 0.5.
  const int64_t n = 32;
  MoeCase c{1, n, n, 1, 1};
  c.store.resize(1);
  for (int i = 0; i < 2; ++i) {
    c.store[0].packed[i].assign(n * n / 2, 0x22);
    c.store[0].scale[i].assign(n, 128);
  }
  c.store[0].packed[2].assign(n * n / 2, 0x99);
  c.store[0].scale[2].assign(n, 127);
  Wire(c, {});
  c.ld_z = c.ld_out = n;
  c.z.assign(n, 0.0078125f);
  c.ids = {0};
  c.weights = {1.5f};
  const double h = 0.5;
  const double act = 4 * std::tanh(h / 4) / (1 + std::exp(-h)) * 25 * std::tanh(h / 25);
  const double want = 1.5 * (-0.5 * 32 * act);
  std::vector<float> out = RunMoe(c);
  // The activation is rounded to BF16 (relative 2^-9) before the down GEMM.
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(out[i], want, 4e-3 * std::fabs(want)) << i;
  // Saturated SiTU through the fp32 decode path: w1 = w3 = code 1 (0.5) at scale
  // 2^126 (E8M0 253), z = 2^-120: h = 32 * 2^125 * 2^-120 = 1024, act = 4 * 25.
  for (int i = 0; i < 2; ++i) {
    c.store[0].packed[i].assign(n * n / 2, 0x11);
    c.store[0].scale[i].assign(n, 253);
  }
  Wire(c, {});
  c.z.assign(n, std::ldexp(1.0f, -120));
  out = RunMoe(c);
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(out[i], 1.5f * -0.5f * 32 * 100) << i;
  const std::vector<float> ref = RunMoeReference(c);
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(ref[i], out[i]) << i;
}

TEST(MoeMxfp4Test, SkippedSlotsAndEmptyRouting) {
  std::mt19937 rng(24);
  // Every slot padding or remote: out is all zeros (overwritten).
  MoeCase c = RandomMoe(rng, 6, 64, 32, 2, 4, {1, 3}, false);
  for (int64_t t = 0; t < c.tokens; ++t) {
    c.ids[t * 2] = (t % 2) ? -1 : 1;
    c.ids[t * 2 + 1] = (t % 3) ? 3 : -5;
  }
  std::vector<float> out = RunMoe(c);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t i = 0; i < c.hidden; ++i) EXPECT_EQ(out[t * c.ld_out + i], 0.0f);
  }
  // top_k = 0: zeros.
  MoeCase k0 = RandomMoe(rng, 3, 64, 32, 0, 4, {}, false);
  out = RunMoe(k0);
  for (int64_t t = 0; t < k0.tokens; ++t) {
    for (int64_t i = 0; i < k0.hidden; ++i) EXPECT_EQ(out[t * k0.ld_out + i], 0.0f);
  }
  // tokens = 0: nothing written.
  MoeCase t0 = RandomMoe(rng, 0, 64, 32, 2, 4, {}, false);
  out = RunMoe(t0);
  EXPECT_EQ(out[0], 123.0f);
}

TEST(MoeMxfp4Test, ExpertIdOutOfRangeIsRecorded) {
  std::mt19937 rng(25);
  MoeCase c = RandomMoe(rng, 4, 64, 32, 2, 4, {}, false);
  c.ids[3] = 4;  // == num_experts
  int32_t error_word = 0;
  RunMoe(c, &error_word);
  EXPECT_EQ(error_word, kExpertIdOutOfRange);
  // The first error wins.
  error_word = kTokenIdOutOfRange;
  RunMoe(c, &error_word);
  EXPECT_EQ(error_word, kTokenIdOutOfRange);
}

TEST(MoeMxfp4Test, K3ExpertCountDecode) {
  // The K3 routing shape (896 experts, top 16) at 2 tokens with small experts:
  // only the 32 routed experts are touched.
  std::mt19937 rng(26);
  const int64_t experts = 896, hidden = 64, inter = 32;
  MoeCase c{2, hidden, inter, 16, experts};
  c.store.resize(experts);
  std::vector<int32_t> perm(experts);
  for (int64_t e = 0; e < experts; ++e) perm[e] = static_cast<int32_t>(e);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<float> wd(0.0f, 0.2f);
  for (int64_t i = 0; i < 32; ++i) {
    c.ids.push_back(perm[i % 20]);  // tokens share 12 experts
    c.weights.push_back(wd(rng));
  }
  for (int64_t i = 0; i < 20; ++i) c.store[perm[i]] = RandomExpert(rng, hidden, inter);
  std::vector<int> remote;
  for (int64_t e = 0; e < experts; ++e) {
    if (c.store[e].packed[0].empty()) remote.push_back(static_cast<int>(e));
  }
  remote.push_back(perm[3]);  // one routed expert on another rank
  Wire(c, remote);
  c.ld_z = c.ld_out = hidden;
  std::normal_distribution<float> nd(0.0f, 0.5f);
  c.z.resize(2 * hidden);
  for (float& v : c.z) v = nd(rng);
  ExpectMoeMatches(c, "K3 experts");
}

}  // namespace
}  // namespace tandem::kernels::cuda
