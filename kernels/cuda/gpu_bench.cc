// GPU kernel benchmark (./tandem bench kernels --backend cuda): the K3 decode and
// prefill kernels of the GPU backend against two yardsticks measured in the same
// run on the same device, and the targets of issue #14 item 6:
//
//   copy     device-to-device copy bandwidth (Device::CopyOnDevice of 1 GiB;
//            bytes read + written), the "measured HBM bandwidth" every memory-bound
//            figure is a fraction of;
//   gemm     the backend's GemmBf16 (cuBLASLt BF16 on "cuda"): 8192^3, and at the
//            same FLOPs as each prefill op (m = 2048 tokens);
//   mla_dec  MLA weight-absorbed decode at K3 TP8 shapes: 12 heads per rank,
//            576-wide latents (kv_lora_rank 512 + rope 64), one query token per
//            sequence, contexts 4k / 32k / 128k, batch 1-64, paged cache (block 64,
//            blocks shuffled): bytes / time / copy bandwidth, target >= 0.7;
//   kda_dec  KDA recurrent decode step (one token per sequence, 12 heads of
//            128 x 128 fp32 state per rank), batch 1-64 sequences (one op per
//            sequence: the interface's KdaArgs is one sequence): target >= 0.7;
//   moe_dec  MXFP4 routed MoE decode, K3 experts (hidden 3584, inter 3072,
//            top-16 of 896), one expert-parallel rank's 112 experts resident
//            (the rest owned by other ranks: null weights), batch 1-32: weight
//            bytes touched / time / copy bandwidth, target >= 0.6;
//   prefill  MLA expanded prefill (2048 tokens, causal), KDA chunked prefill
//            (2048 tokens) and the MoE grouped GEMM at batch 2048 in TFLOP/s
//            against GemmBf16 at the same FLOPs: target >= 0.5; with them the
//            vision tower's attention over one 4096-patch image (K3's 12 heads
//            of 128; the tensor-core kernel, split-BF16: three mma a product).
//
// Timing: wall clock around back-to-back enqueued ops followed by one
// Synchronize (best of 3 rounds of >= --min_time_s each); launch overhead is
// part of every figure, as it is in serving without CUDA graphs. Every op's
// status is checked; a failed or unsupported op is listed and skipped.
//
// "cuda_bf16" is the same backend with activations rounded to BF16 once (the
// faster kernels; "cuda" is exact, its tokens match the CPU backend's).
// On "cuda_sim" (the default build) the same harness runs tiny shapes on the
// SIMT emulator to prove it end to end: those figures are EMULATED, not
// performance, and the output says so. Ends with ONE JSON line
// {"bench":"gpu_kernels",...}.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/bf16.h"
#include "kernels/device.h"

ABSL_FLAG(std::string, backend, "cuda",
          "cuda or cuda_bf16 (a GPU; --config=cuda builds; exact, or activations "
          "rounded to BF16 once) or cuda_sim / cuda_sim_bf16 (the emulator: tiny "
          "shapes, harness check only)");
ABSL_FLAG(double, min_time_s, 0.05, "minimum timed seconds per round (3 rounds)");
ABSL_FLAG(bool, quick, false, "fewer shapes (batch 1 and the largest only)");
ABSL_FLAG(std::string, only, "",
          "comma-separated sections to run (copy,gemm,mla,kda,moe,prefill); "
          "empty = all (copy and gemm always run: they are the yardsticks)");

namespace tandem::kernels {
namespace {

using Clock = std::chrono::steady_clock;

bool g_emulated = false;
std::map<std::string, double> g_json;
std::vector<std::string> g_errors;

void Record(const std::string& key, double v) { g_json[key] = v; }
void Fail(const std::string& what, const absl::Status& s) {
  std::printf("  %-34s ERROR %s\n", what.c_str(), s.ToString().c_str());
  g_errors.push_back(what + ": " + std::string(s.message()));
}

// ---- Device memory helpers ----------------------------------------------------
struct Buffers {
  Device* device;
  std::vector<DeviceBuffer> owned;
  absl::Status status;

  template <typename T>
  T* Alloc(size_t count) {
    if (!status.ok()) return nullptr;
    auto b = DeviceBuffer::Allocate(device, std::max<size_t>(count, 1) * sizeof(T));
    if (!b.ok()) {
      status = b.status();
      return nullptr;
    }
    owned.push_back(std::move(b).value());
    return owned.back().as<T>();
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* p = Alloc<T>(host.size());
    if (p != nullptr && !host.empty()) {
      absl::Status s = device->CopyToDevice(p, host.data(), host.size() * sizeof(T));
      if (!s.ok()) status = s;
    }
    return p;
  }
  // Fills `bytes` of device memory from a host pattern of at most 64 MiB,
  // replicated on the device (large caches and expert banks are not uploaded
  // whole: a 10 GB upload would dominate the run).
  void Fill(void* dst, size_t bytes, std::mt19937& rng, bool bf16_values) {
    if (!status.ok() || bytes == 0) return;
    const size_t chunk = std::min<size_t>(bytes, size_t{64} << 20);
    std::vector<uint8_t> host(chunk);
    if (bf16_values) {
      // Normal(0, 1) BF16 values (no NaN/Inf patterns in caches).
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (size_t i = 0; i + 1 < chunk; i += 2) {
        const uint16_t v = F32ToBf16(nd(rng));
        std::memcpy(&host[i], &v, 2);
      }
    } else {
      std::uniform_int_distribution<int> bd(0, 255);
      for (auto& b : host) b = static_cast<uint8_t>(bd(rng));
    }
    uint8_t* d = static_cast<uint8_t*>(dst);
    absl::Status s = device->CopyToDevice(d, host.data(), chunk);
    for (size_t off = chunk; s.ok() && off < bytes; off += chunk) {
      s = device->CopyOnDevice(d + off, d, std::min(chunk, bytes - off));
    }
    if (s.ok()) s = device->Synchronize();
    if (!s.ok()) status = s;
  }
};

std::vector<float> RandomF32(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// Seconds per call of `op` (which enqueues one or more ops and returns their
// status): one warm-up call, then 3 rounds of back-to-back calls lasting at
// least min_time_s each, each round ended by Synchronize; the best round's
// average. The emulator: one timed call (its figures are not performance).
absl::StatusOr<double> TimeOp(Backend& be, const std::function<absl::Status()>& op) {
  absl::Status s = op();
  if (s.ok()) s = be.Synchronize();
  if (!s.ok()) return s;
  if (g_emulated) {
    const auto t0 = Clock::now();
    s = op();
    if (s.ok()) s = be.Synchronize();
    if (!s.ok()) return s;
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  const double min_time = absl::GetFlag(FLAGS_min_time_s);
  // Estimate one call, then size the rounds.
  auto t0 = Clock::now();
  s = op();
  if (s.ok()) s = be.Synchronize();
  if (!s.ok()) return s;
  const double one =
      std::max(1e-7, std::chrono::duration<double>(Clock::now() - t0).count());
  const int64_t iters =
      std::clamp<int64_t>(static_cast<int64_t>(min_time / one), 3, 100000);
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    t0 = Clock::now();
    for (int64_t i = 0; i < iters && s.ok(); ++i) s = op();
    if (s.ok()) s = be.Synchronize();
    if (!s.ok()) return s;
    best = std::min(best,
                    std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  return best;
}

// ---- Yardsticks ---------------------------------------------------------------
// Device-to-device copy: B bytes copied move 2B (read + write).
double CopyBandwidth(Backend& be) {
  Device& dev = be.device();
  const size_t bytes = g_emulated ? (size_t{1} << 20) : (size_t{1} << 30);
  Buffers buf{&dev};
  char* src = buf.Alloc<char>(bytes);
  char* dst = buf.Alloc<char>(bytes);
  std::mt19937 rng(1);
  buf.Fill(src, bytes, rng, false);
  if (!buf.status.ok()) {
    Fail("copy", buf.status);
    return 0;
  }
  auto t = TimeOp(be, [&] { return dev.CopyOnDevice(dst, src, bytes); });
  if (!t.ok()) {
    Fail("copy", t.status());
    return 0;
  }
  const double gbs = 2.0 * bytes / *t / 1e9;
  std::printf("device copy %zu MiB: %.1f GB/s (read + write)\n", bytes >> 20, gbs);
  Record("copy_gbs", gbs);
  return gbs;
}

// GemmBf16 TFLOP/s at m x n x k (FLOPs = 2mnk); 0 on error.
double GemmTflops(Backend& be, int64_t m, int64_t n, int64_t k,
                  const std::string& what) {
  Buffers buf{&be.device()};
  std::mt19937 rng(2);
  float* x = buf.Alloc<float>(m * k);
  uint16_t* w = buf.Alloc<uint16_t>(n * k);
  float* y = buf.Alloc<float>(m * n);
  buf.Fill(x, m * k * sizeof(float), rng, true);  // BF16 pairs read as fp32: finite
  buf.Fill(w, n * k * sizeof(uint16_t), rng, true);
  if (!buf.status.ok()) {
    Fail(what, buf.status);
    return 0;
  }
  auto t = TimeOp(be, [&] { return be.GemmBf16(x, k, w, k, y, n, m, n, k, false); });
  if (!t.ok()) {
    Fail(what, t.status());
    return 0;
  }
  return 2.0 * m * n * k / *t / 1e12;
}

// The same-FLOPs yardstick of a prefill op: m = 2048 tokens, k = `k`,
// n = FLOPs / (2 m k) rounded to a multiple of 64.
double GemmAtFlops(Backend& be, double flops, int64_t m, int64_t k,
                   const std::string& what) {
  const int64_t n =
      std::max<int64_t>(64, std::llround(flops / (2.0 * m * k) / 64) * 64);
  const double tf = GemmTflops(be, m, n, k, what);
  std::printf("  %-34s %8.1f TFLOP/s  (GemmBf16 %lldx%lldx%lld)\n", what.c_str(), tf,
              static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k));
  return tf;
}

const char* Verdict(double ratio, double target) {
  if (g_emulated) return "(emul.)";
  if (ratio <= 0) return "n/a";
  return ratio >= target ? "meets" : "BELOW";
}

bool Wanted(const std::string& section) {
  const std::string only = absl::GetFlag(FLAGS_only);
  if (only.empty()) return true;
  return ("," + only + ",").find("," + section + ",") != std::string::npos;
}

// ---- MLA -------------------------------------------------------------------------
struct MlaShape {
  int64_t heads = 12, nope = 128, rope = 64, v = 128, lora = 512, block = 64;
};

// A paged MLA problem: `batch` sequences of `ctx` cached tokens with `q_len`
// queries each, blocks of one shared pool handed out in shuffled order.
struct MlaProblem {
  Buffers buf;
  MlaArgs args;
};

std::unique_ptr<MlaProblem> MakeMla(Backend& be, const MlaShape& sh, int64_t batch,
                                    int64_t ctx, int64_t q_len, uint16_t* cache,
                                    int64_t num_blocks, std::mt19937& rng) {
  auto p = std::make_unique<MlaProblem>(MlaProblem{Buffers{&be.device()}, {}});
  const int64_t bps = (ctx + sh.block - 1) / sh.block;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(batch * bps), seq_lens(batch, static_cast<int32_t>(ctx)),
      qstart(batch + 1);
  for (int64_t i = 0; i < batch * bps; ++i) tables[i] = perm[i % num_blocks];
  for (int64_t s = 0; s <= batch; ++s) qstart[s] = static_cast<int32_t>(s * q_len);
  const int64_t tokens = batch * q_len, qw = sh.nope + sh.rope;
  std::vector<uint16_t> wkv(sh.heads * (sh.nope + sh.v) * sh.lora);
  std::normal_distribution<float> nd(0.0f, 0.04f);
  for (auto& x : wkv) x = F32ToBf16(nd(rng));
  MlaArgs& a = p->args;
  a.heads = sh.heads;
  a.nope_dim = sh.nope;
  a.rope_dim = sh.rope;
  a.v_dim = sh.v;
  a.kv_lora_rank = sh.lora;
  a.scale = 1.0f / std::sqrt(static_cast<float>(qw));
  a.num_seqs = batch;
  a.num_tokens = tokens;
  a.seq_lens = p->buf.Upload(seq_lens);
  a.query_start = p->buf.Upload(qstart);
  a.block_tables = p->buf.Upload(tables);
  a.block_table_stride = bps;
  a.kv_cache = cache;
  a.num_blocks = num_blocks;
  a.block_size = sh.block;
  a.kv_b_proj = p->buf.Upload(wkv);
  a.q = p->buf.Upload(RandomF32(tokens * sh.heads * qw, rng));
  a.ld_q = sh.heads * qw;
  a.out = p->buf.Alloc<float>(tokens * sh.heads * sh.v);
  a.ld_out = sh.heads * sh.v;
  return p;
}

// One absorbed-MLA row of the table: `batch` sequences of `ctx` cached tokens,
// `q_len` queries each (1: decode; > 1: a speculative verification).
void MlaAbsorbedRow(Backend& be, const MlaShape& sh, int64_t batch, int64_t ctx,
                    int64_t q_len, uint16_t* cache, int64_t num_blocks,
                    std::mt19937& rng, double copy_gbs, const std::string& key,
                    const double* target) {
  const int64_t width = sh.lora + sh.rope;
  auto p = MakeMla(be, sh, batch, ctx, q_len, cache, num_blocks, rng);
  if (!p->buf.status.ok()) {
    Fail(key, p->buf.status);
    return;
  }
  auto t = TimeOp(be, [&] { return be.MlaAttentionAbsorbed(p->args); });
  if (!t.ok()) {
    Fail(key, t.status());
    return;
  }
  // Bytes moved: every cached latent row read once (ctx * (lora + rope) BF16
  // per sequence), the absorbed weights W_UK/W_UV once (heads * (nope + v) *
  // lora BF16), q in (fp32), out (fp32), block tables (int32).
  const double tokens = static_cast<double>(batch * q_len);
  const double bytes =
      batch * ctx * width * 2.0 + sh.heads * (sh.nope + sh.v) * sh.lora * 2.0 +
      tokens * sh.heads * (sh.nope + sh.rope) * 4.0 + tokens * sh.heads * sh.v * 4.0 +
      batch * ((ctx + sh.block - 1) / sh.block) * 4.0;
  const double gbs = bytes / *t / 1e9, frac = copy_gbs > 0 ? gbs / copy_gbs : 0;
  std::printf("%-22s %10.1f %10.1f %10.3f %9s\n",
              absl::StrCat("ctx ", ctx, " b ", batch, q_len > 1 ? " q " : "",
                           q_len > 1 ? absl::StrCat(q_len) : "")
                  .c_str(),
              *t * 1e6, gbs, frac, target != nullptr ? Verdict(frac, *target) : "-");
  Record(key + "_us", *t * 1e6);
  Record(key + "_gbs", gbs);
  Record(key + "_bw_frac", frac);
}

void MlaDecode(Backend& be, double copy_gbs) {
  if (!be.Supports(Op::kMlaAttentionAbsorbed)) {
    std::printf("MLA absorbed decode: not supported by %s (skipped)\n",
                std::string(be.name()).c_str());
    g_errors.push_back("MlaAttentionAbsorbed: unsupported");
    return;
  }
  MlaShape sh;
  std::vector<int64_t> contexts = {4096, 32768, 131072}, batches = {1, 8, 32, 64};
  // Speculative verification: 4 queries a sequence (3 drafts and the token
  // before them), 48 (query, head) rows per cached key: the split-BF16 form's
  // two mma a product make it compute-bound where the BF16 form ("cuda_bf16")
  // is not. No target (not in the list).
  int64_t verify_ctx = 32768;
  std::vector<int64_t> verify_batches = {1, 8, 32};
  if (g_emulated) {
    sh.block = 16;
    contexts = {64, 200};
    batches = {1, 2};
    verify_ctx = 200;
    verify_batches = {1};
  } else if (absl::GetFlag(FLAGS_quick)) {
    batches = {1, 64};
    verify_batches = {8};
  }
  constexpr int64_t kVerifyQueries = 4;
  const int64_t max_tokens = contexts.back() * batches.back();
  const int64_t width = sh.lora + sh.rope;
  const int64_t num_blocks = (max_tokens + sh.block - 1) / sh.block;
  Buffers pool{&be.device()};
  std::mt19937 rng(3);
  uint16_t* cache = pool.Alloc<uint16_t>(num_blocks * sh.block * width);
  pool.Fill(cache, num_blocks * sh.block * width * sizeof(uint16_t), rng, true);
  if (!pool.status.ok()) {
    Fail("mla cache", pool.status);
    return;
  }
  std::printf(
      "MLA absorbed decode (heads %lld, latent %lld, block %lld, 1 query/seq; then "
      "%lld "
      "queries/seq, a verification): bytes = sum ctx * %lld * 2 (cache) + W_kv + q + "
      "out\n%-22s %10s %10s %10s %9s\n",
      static_cast<long long>(sh.heads), static_cast<long long>(width),
      static_cast<long long>(sh.block), static_cast<long long>(kVerifyQueries),
      static_cast<long long>(width), "shape", "us", "GB/s", "of copy", "target");
  const double target = 0.7;
  for (int64_t ctx : contexts) {
    for (int64_t batch : batches) {
      MlaAbsorbedRow(be, sh, batch, ctx, 1, cache, num_blocks, rng, copy_gbs,
                     absl::StrCat("mla_dec_ctx", ctx, "_b", batch), &target);
    }
  }
  for (int64_t batch : verify_batches) {
    MlaAbsorbedRow(
        be, sh, batch, verify_ctx, kVerifyQueries, cache, num_blocks, rng, copy_gbs,
        absl::StrCat("mla_verify_ctx", verify_ctx, "_b", batch, "_q", kVerifyQueries),
        nullptr);
  }
}

// ---- KDA ---------------------------------------------------------------------------
struct KdaShape {
  int64_t heads = 12, dk = 128, dv = 128;
};

struct KdaProblem {
  Buffers buf;
  std::vector<KdaArgs> seqs;  // one KdaArgs per sequence
};

std::unique_ptr<KdaProblem> MakeKda(Backend& be, const KdaShape& sh, int64_t batch,
                                    int64_t tokens, std::mt19937& rng) {
  auto p = std::make_unique<KdaProblem>(KdaProblem{Buffers{&be.device()}, {}});
  const int64_t h = sh.heads, dk = sh.dk, dv = sh.dv;
  // q and k unit-norm-ish per head (the caller L2-normalises), g <= 0 small decay.
  std::vector<float> g(tokens * h * dk), beta(tokens * h, 0.5f);
  std::uniform_real_distribution<float> gd(-0.1f, 0.0f);
  for (float& x : g) x = gd(rng);
  for (int64_t s = 0; s < batch; ++s) {
    KdaArgs a;
    a.tokens = tokens;
    a.heads = h;
    a.head_dim_k = dk;
    a.head_dim_v = dv;
    a.q = p->buf.Upload(RandomF32(tokens * h * dk, rng, 1.0f / std::sqrt(dk * 1.0f)));
    a.k = p->buf.Upload(RandomF32(tokens * h * dk, rng, 1.0f / std::sqrt(dk * 1.0f)));
    a.ld_qk = h * dk;
    a.v = p->buf.Upload(RandomF32(tokens * h * dv, rng));
    a.ld_v = h * dv;
    a.g = p->buf.Upload(g);
    a.beta = p->buf.Upload(beta);
    a.state = p->buf.Upload(RandomF32(h * dk * dv, rng, 0.01f));
    a.out = p->buf.Alloc<float>(tokens * h * dv);
    a.ld_out = h * dv;
    p->seqs.push_back(a);
  }
  return p;
}

void KdaDecode(Backend& be, double copy_gbs) {
  if (!be.Supports(Op::kKdaRecurrent)) {
    std::printf("KDA decode: not supported by %s (skipped)\n",
                std::string(be.name()).c_str());
    g_errors.push_back("KdaRecurrent: unsupported");
    return;
  }
  KdaShape sh;
  std::vector<int64_t> batches = {1, 8, 32, 64};
  if (g_emulated) {
    sh.heads = 2;
    batches = {1, 2};
  } else if (absl::GetFlag(FLAGS_quick)) {
    batches = {1, 64};
  }
  std::printf(
      "KDA recurrent decode step (heads %lld, state %lldx%lld fp32, one op per "
      "sequence): bytes = state read + written + q,k,v,g,beta,out\n%-22s %10s %10s "
      "%10s %9s\n",
      static_cast<long long>(sh.heads), static_cast<long long>(sh.dk),
      static_cast<long long>(sh.dv), "shape", "us", "GB/s", "of copy", "target");
  std::mt19937 rng(4);
  for (int64_t batch : batches) {
    const std::string key = absl::StrCat("kda_dec_b", batch);
    auto p = MakeKda(be, sh, batch, 1, rng);
    if (!p->buf.status.ok()) {
      Fail(key, p->buf.status);
      continue;
    }
    auto t = TimeOp(be, [&]() -> absl::Status {
      for (const KdaArgs& a : p->seqs) {
        absl::Status s = be.KdaRecurrent(a);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    });
    if (!t.ok()) {
      Fail(key, t.status());
      continue;
    }
    // Bytes per sequence and step: the fp32 state read and written (2 * h*dk*dv*4),
    // q, k, g (h*dk*4 each), v and out (h*dv*4 each), beta (h*4).
    const double per_seq = 2.0 * sh.heads * sh.dk * sh.dv * 4 +
                           3.0 * sh.heads * sh.dk * 4 + 2.0 * sh.heads * sh.dv * 4 +
                           sh.heads * 4.0;
    const double gbs = batch * per_seq / *t / 1e9,
                 frac = copy_gbs > 0 ? gbs / copy_gbs : 0;
    std::printf("%-22s %10.1f %10.1f %10.3f %9s\n",
                absl::StrCat("batch ", batch).c_str(), *t * 1e6, gbs, frac,
                Verdict(frac, 0.7));
    Record(key + "_us", *t * 1e6);
    Record(key + "_gbs", gbs);
    Record(key + "_bw_frac", frac);
  }
}

// ---- MoE ---------------------------------------------------------------------------
struct MoeShape {
  int64_t hidden = 3584, inter = 3072, top_k = 16, num_experts = 896, local = 112;
};

struct MoeProblem {
  Buffers buf;
  MoeArgs args;
  int64_t distinct_local = 0;  // local experts hit by at least one token
  int64_t pairs_local = 0;     // (token, local expert) pairs
};

// Resident expert weights of one rank: `local` experts' packed nibbles and
// scales in one allocation each.
struct ExpertBank {
  Buffers buf;
  std::vector<Mxfp4Expert> experts;  // [num_experts], null beyond `local`
};

std::unique_ptr<ExpertBank> MakeExperts(Backend& be, const MoeShape& sh,
                                        std::mt19937& rng) {
  auto bank = std::make_unique<ExpertBank>(ExpertBank{Buffers{&be.device()}, {}});
  const size_t packed = sh.inter * sh.hidden / 2, scales = sh.inter * sh.hidden / 32;
  uint8_t* w = bank->buf.Alloc<uint8_t>(3 * packed * sh.local);
  uint8_t* sc = bank->buf.Alloc<uint8_t>(3 * scales * sh.local);
  bank->buf.Fill(w, 3 * packed * sh.local, rng, false);
  if (!bank->buf.status.ok()) return bank;
  // E8M0 scales near 2^0 (0x7C..0x80): finite outputs.
  std::vector<uint8_t> host_scales(3 * scales * sh.local);
  std::uniform_int_distribution<int> sd(0x7C, 0x80);
  for (auto& s : host_scales) s = static_cast<uint8_t>(sd(rng));
  absl::Status s = be.device().CopyToDevice(sc, host_scales.data(), host_scales.size());
  if (!s.ok()) bank->buf.status = s;
  bank->experts.resize(sh.num_experts);
  for (int64_t e = 0; e < sh.local; ++e) {
    Mxfp4Expert& x = bank->experts[e];
    x.w1_packed = w + (3 * e + 0) * packed;
    x.w3_packed = w + (3 * e + 1) * packed;
    x.w2_packed = w + (3 * e + 2) * packed;
    x.w1_scale = sc + (3 * e + 0) * scales;
    x.w3_scale = sc + (3 * e + 1) * scales;
    x.w2_scale = sc + (3 * e + 2) * scales;
  }
  return bank;
}

// Tokens routed uniformly at random: top_k distinct experts of num_experts each.
std::unique_ptr<MoeProblem> MakeMoe(Backend& be, const MoeShape& sh,
                                    const ExpertBank& bank, int64_t tokens,
                                    std::mt19937& rng) {
  auto p = std::make_unique<MoeProblem>(MoeProblem{Buffers{&be.device()}, {}});
  std::vector<int32_t> ids(tokens * sh.top_k), all(sh.num_experts);
  std::vector<float> weights(tokens * sh.top_k, 1.0f / sh.top_k);
  std::iota(all.begin(), all.end(), 0);
  std::vector<bool> hit(sh.local, false);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t i = 0; i < sh.top_k; ++i) {
      ids[t * sh.top_k + i] = all[i];
      if (all[i] < sh.local) {
        hit[all[i]] = true;
        ++p->pairs_local;
      }
    }
  }
  p->distinct_local = std::count(hit.begin(), hit.end(), true);
  MoeArgs& a = p->args;
  a.tokens = tokens;
  a.hidden = sh.hidden;
  a.inter = sh.inter;
  a.top_k = sh.top_k;
  a.num_experts = sh.num_experts;
  a.experts = p->buf.Upload(bank.experts);
  a.z = p->buf.Upload(RandomF32(tokens * sh.hidden, rng));
  a.ld_z = sh.hidden;
  a.ids = p->buf.Upload(ids);
  a.weights = p->buf.Upload(weights);
  a.out = p->buf.Alloc<float>(tokens * sh.hidden);
  a.ld_out = sh.hidden;
  return p;
}

// Weight bytes of one MXFP4 expert: w1, w3 [inter, hidden] and w2 [hidden, inter],
// each inter*hidden/2 packed bytes + inter*hidden/32 E8M0 scale bytes.
double ExpertBytes(const MoeShape& sh) {
  return 3.0 * sh.inter * sh.hidden * (0.5 + 1.0 / 32);
}

MoeShape MoeShapeForRun() {
  MoeShape sh;
  if (g_emulated) {
    sh.hidden = 256;
    sh.inter = 128;
    sh.top_k = 4;
    sh.num_experts = 16;
    sh.local = 4;
  }
  return sh;
}

void MoeDecode(Backend& be, double copy_gbs, ExpertBank* bank, const MoeShape& sh) {
  std::vector<int64_t> batches = {1, 4, 8, 16, 32};
  if (g_emulated) {
    batches = {1, 2};
  } else if (absl::GetFlag(FLAGS_quick)) {
    batches = {1, 32};
  }
  std::printf(
      "MXFP4 MoE decode (hidden %lld, inter %lld, top-%lld of %lld, %lld resident): "
      "bytes = distinct resident experts hit * %.1f MB + activations\n%-22s %8s %10s "
      "%10s %10s %9s\n",
      static_cast<long long>(sh.hidden), static_cast<long long>(sh.inter),
      static_cast<long long>(sh.top_k), static_cast<long long>(sh.num_experts),
      static_cast<long long>(sh.local), ExpertBytes(sh) / 1e6, "shape", "experts", "us",
      "GB/s", "of copy", "target");
  std::mt19937 rng(5);
  for (int64_t batch : batches) {
    const std::string key = absl::StrCat("moe_dec_b", batch);
    auto p = MakeMoe(be, sh, *bank, batch, rng);
    if (!p->buf.status.ok()) {
      Fail(key, p->buf.status);
      continue;
    }
    auto t = TimeOp(be, [&] { return be.MoeMxfp4(p->args); });
    if (!t.ok()) {
      Fail(key, t.status());
      continue;
    }
    // Weight bytes touched: each resident expert hit by >= 1 token read once
    // (ExpertBytes); plus z in and out (tokens * hidden * 4 each), ids, weights.
    const double bytes = p->distinct_local * ExpertBytes(sh) +
                         2.0 * batch * sh.hidden * 4 + batch * sh.top_k * 8.0;
    const double gbs = bytes / *t / 1e9, frac = copy_gbs > 0 ? gbs / copy_gbs : 0;
    std::printf("%-22s %8lld %10.1f %10.1f %10.3f %9s\n",
                absl::StrCat("batch ", batch).c_str(),
                static_cast<long long>(p->distinct_local), *t * 1e6, gbs, frac,
                Verdict(frac, 0.6));
    Record(key + "_us", *t * 1e6);
    Record(key + "_experts", p->distinct_local);
    Record(key + "_gbs", gbs);
    Record(key + "_bw_frac", frac);
  }
}

// ---- Prefill (TFLOP/s against GemmBf16 at the same FLOPs) ---------------------------
void ReportPrefill(const std::string& key, const std::string& label, double flops,
                   double seconds, double gemm_tflops) {
  const double tf = flops / seconds / 1e12;
  const double ratio = gemm_tflops > 0 ? tf / gemm_tflops : 0;
  std::printf("  %-34s %8.1f TFLOP/s  %.3f of GEMM (target 0.5: %s)\n", label.c_str(),
              tf, ratio, Verdict(ratio, 0.5));
  Record(key + "_tflops", tf);
  Record(key + "_gemm_tflops", gemm_tflops);
  Record(key + "_vs_gemm", ratio);
}

void Prefill(Backend& be, ExpertBank* bank, const MoeShape& moe_sh) {
  const int64_t tokens = g_emulated ? 32 : 2048;
  std::printf("Prefill at %lld tokens vs GemmBf16 at the same FLOPs (m = %lld)\n",
              static_cast<long long>(tokens), static_cast<long long>(tokens));
  std::mt19937 rng(6);
  // MLA expanded: one sequence of `tokens` new tokens (causal, no prior context).
  // FLOPs = expansion 2*T*lora*heads*(nope+v) + scores 2*heads*T(T+1)/2*(nope+rope)
  //       + P*V 2*heads*T(T+1)/2*v.
  if (be.Supports(Op::kMlaAttentionExpanded)) {
    MlaShape sh;
    if (g_emulated) sh.block = 16;
    const int64_t num_blocks = (tokens + sh.block - 1) / sh.block;
    Buffers pool{&be.device()};
    uint16_t* cache = pool.Alloc<uint16_t>(num_blocks * sh.block * (sh.lora + sh.rope));
    pool.Fill(cache, num_blocks * sh.block * (sh.lora + sh.rope) * 2, rng, true);
    auto p = MakeMla(be, sh, 1, tokens, tokens, cache, num_blocks, rng);
    const double tri = tokens * (tokens + 1) / 2.0;
    const double flops = 2.0 * tokens * sh.lora * sh.heads * (sh.nope + sh.v) +
                         2.0 * sh.heads * tri * (sh.nope + sh.rope) +
                         2.0 * sh.heads * tri * sh.v;
    absl::Status st = pool.status.ok() ? p->buf.status : pool.status;
    absl::StatusOr<double> t =
        st.ok() ? TimeOp(be, [&] { return be.MlaAttentionExpanded(p->args); })
                : absl::StatusOr<double>(st);
    if (!t.ok()) {
      Fail("mla_prefill", t.status());
    } else {
      const double g = GemmAtFlops(be, flops, tokens, 7168, "gemm @ mla_prefill FLOPs");
      ReportPrefill("mla_prefill", "MLA expanded prefill", flops, *t, g);
    }
  } else {
    g_errors.push_back("MlaAttentionExpanded: unsupported");
  }
  // KDA chunked (chunk C = 64): FLOPs = T*h*(6*dk*dv + C*(2*dk + dv)): the state
  // products (q S, k S, the k^T u update: 2*dk*dv each) and the intra-chunk
  // K K^T, Q K^T, A V on their causal halves.
  if (be.Supports(Op::kKdaChunked)) {
    KdaShape sh;
    if (g_emulated) sh.heads = 2;
    auto p = MakeKda(be, sh, 1, tokens, rng);
    const double flops =
        tokens * sh.heads * (6.0 * sh.dk * sh.dv + 64.0 * (2 * sh.dk + sh.dv));
    absl::StatusOr<double> t =
        p->buf.status.ok() ? TimeOp(be, [&] { return be.KdaChunked(p->seqs[0]); })
                           : absl::StatusOr<double>(p->buf.status);
    if (!t.ok()) {
      Fail("kda_prefill", t.status());
    } else {
      const double g = GemmAtFlops(be, flops, tokens, 7168, "gemm @ kda_prefill FLOPs");
      ReportPrefill("kda_prefill", "KDA chunked prefill", flops, *t, g);
    }
  } else {
    g_errors.push_back("KdaChunked: unsupported");
  }
  // MoE grouped GEMM: FLOPs = (token, resident expert) pairs * 6 * hidden * inter
  // (w1 and w3: 2*2*hidden*inter, w2: 2*inter*hidden).
  if (be.Supports(Op::kMoeMxfp4) && bank != nullptr) {
    auto p = MakeMoe(be, moe_sh, *bank, tokens, rng);
    const double flops = p->pairs_local * 6.0 * moe_sh.hidden * moe_sh.inter;
    absl::StatusOr<double> t = p->buf.status.ok()
                                   ? TimeOp(be, [&] { return be.MoeMxfp4(p->args); })
                                   : absl::StatusOr<double>(p->buf.status);
    if (!t.ok()) {
      Fail("moe_prefill", t.status());
    } else {
      const double g =
          GemmAtFlops(be, flops, tokens, moe_sh.hidden, "gemm @ moe_prefill FLOPs");
      ReportPrefill("moe_prefill", "MXFP4 MoE grouped GEMM", flops, *t, g);
    }
  } else {
    g_errors.push_back("MoeMxfp4 (prefill): unsupported");
  }
  // The vision tower's attention (non-causal within one image): K3's 12 heads of
  // 128 over one image of `patches` patches (4096: an 896 x 896 image at 14-pixel
  // patches). FLOPs = 4 * heads * n^2 * head_dim (S = Q K^T and P V). One call per
  // tower layer (27 for K3).
  if (be.Supports(Op::kVisionAttention)) {
    const int64_t patches = g_emulated ? 80 : 4096, heads = 12, hd = 128;
    const int64_t width = heads * hd;
    Buffers buf{&be.device()};
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(patches)};
    float* qkv = buf.Upload(RandomF32(patches * 3 * width, rng));
    float* out = buf.Alloc<float>(patches * width);
    const int32_t* cu_dev = buf.Upload(cu);
    VisionAttnArgs a;
    a.heads = heads;
    a.head_dim = hd;
    a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    a.num_images = 1;
    a.num_tokens = patches;
    a.max_seqlen = patches;
    a.cu_seqlens = cu_dev;
    a.q = qkv;
    a.k = qkv + width;
    a.v = qkv + 2 * width;
    a.ld_qkv = 3 * width;
    a.out = out;
    a.ld_out = width;
    const double flops = 4.0 * heads * patches * patches * hd;
    absl::StatusOr<double> t = buf.status.ok()
                                   ? TimeOp(be, [&] { return be.VisionAttention(a); })
                                   : absl::StatusOr<double>(buf.status);
    if (!t.ok()) {
      Fail("vision_attention", t.status());
    } else {
      const double g =
          GemmAtFlops(be, flops, tokens, 1024, "gemm @ vision_attention FLOPs");
      ReportPrefill("vision_attention",
                    absl::StrCat("vision attention (", patches, " patches)"), flops, *t,
                    g);
    }
  }
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

int Main() {
  const std::string name = absl::GetFlag(FLAGS_backend);
  if (name != "cuda" && name != "cuda_bf16" && name != "cuda_sim" &&
      name != "cuda_sim_bf16") {
    std::fprintf(
        stderr,
        "gpu_bench: --backend must be cuda, cuda_bf16, cuda_sim or cuda_sim_bf16, "
        "not %s\n",
        name.c_str());
    return 2;
  }
  auto created = CreateBackend(name);
  if (!created.ok()) {
    std::fprintf(stderr, "gpu_bench: backend %s: %s\n", name.c_str(),
                 created.status().ToString().c_str());
    std::printf(
        "{\"bench\":\"gpu_kernels\",\"backend\":\"%s\",\"ok\":false,\"error\":\"%s\"}"
        "\n",
        name.c_str(), JsonEscape(created.status().ToString()).c_str());
    return 1;
  }
  Backend& be = **created;
  g_emulated = absl::StartsWith(name, "cuda_sim");
  std::printf("gpu_bench: backend %s on %s%s\n", std::string(be.name()).c_str(),
              std::string(be.device().name()).c_str(),
              g_emulated
                  ? "  ** EMULATED (SIMT emulator on the CPU): tiny shapes, "
                    "harness check only; these figures are NOT GPU performance **"
                  : "");
  const DeviceMemoryInfo mem = be.device().MemoryInfo();
  std::printf("device memory: %.1f GiB total, %.1f GiB free\n",
              mem.total_bytes / 1073741824.0, mem.free_bytes / 1073741824.0);

  const double copy_gbs = CopyBandwidth(be);
  {
    const int64_t s = g_emulated ? 64 : 8192;
    const double tf = GemmTflops(be, s, s, s, "gemm");
    std::printf("GemmBf16 %lld^3: %.1f TFLOP/s\n", static_cast<long long>(s), tf);
    Record(absl::StrCat("gemm_", s, "_tflops"), tf);
  }
  if (Wanted("mla")) MlaDecode(be, copy_gbs);
  if (Wanted("kda")) KdaDecode(be, copy_gbs);
  const MoeShape moe_sh = MoeShapeForRun();
  std::unique_ptr<ExpertBank> bank;
  if ((Wanted("moe") || Wanted("prefill")) && be.Supports(Op::kMoeMxfp4)) {
    std::mt19937 rng(7);
    bank = MakeExperts(be, moe_sh, rng);
    if (!bank->buf.status.ok()) {
      Fail("moe experts", bank->buf.status);
      bank.reset();
    }
  }
  if (Wanted("moe")) {
    if (bank != nullptr) {
      MoeDecode(be, copy_gbs, bank.get(), moe_sh);
    } else if (!be.Supports(Op::kMoeMxfp4)) {
      std::printf("MXFP4 MoE decode: not supported by %s (skipped)\n",
                  std::string(be.name()).c_str());
      g_errors.push_back("MoeMxfp4: unsupported");
    }
  }
  if (Wanted("prefill")) Prefill(be, bank.get(), moe_sh);

  // One JSON line: the figures, the targets, what failed.
  std::string line =
      absl::StrCat("{\"bench\":\"gpu_kernels\",\"backend\":\"", name,
                   "\",\"device\":\"", JsonEscape(std::string(be.device().name())),
                   "\",\"emulated\":", g_emulated ? "true" : "false",
                   ",\"ok\":", g_errors.empty() ? "true" : "false",
                   ",\"targets\":{\"mla_dec_bw_frac\":0.7,\"kda_dec_bw_frac\":0.7,"
                   "\"moe_dec_bw_frac\":0.6,\"prefill_vs_gemm\":0.5}");
  for (const auto& [k, v] : g_json) {
    char num[64];
    std::snprintf(num, sizeof num, "%.6g", std::isfinite(v) ? v : 0.0);
    absl::StrAppend(&line, ",\"", k, "\":", num);
  }
  absl::StrAppend(&line, ",\"errors\":[");
  for (size_t i = 0; i < g_errors.size(); ++i) {
    absl::StrAppend(&line, i ? "," : "", "\"", JsonEscape(g_errors[i]), "\"");
  }
  absl::StrAppend(&line, "]}");
  std::printf("%s\n", line.c_str());
  // Unsupported ops are not a harness failure; op errors are.
  for (const std::string& e : g_errors) {
    if (e.find("unsupported") == std::string::npos) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace tandem::kernels

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "gpu_bench",
      "GPU kernel benchmark: gpu_bench [--backend cuda|cuda_sim] [--quick]");
  return tandem::kernels::Main();
}
