// The mla kernels (mla.cu) on the SIMT emulator, launched directly on host vectors
// (under cuda_sim device memory is host memory), against the fp64 oracle
// (CreateReferenceBackend) at the conformance bound 2e-5 * max|want|.
#include "kernels/cuda/mla.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
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

struct Case {
  int64_t heads, nope, rope, v, lora;
  std::vector<int32_t> ctx, q_len;
};

// One call's inputs: a paged cache with shuffled block ids (block 0 unused),
// latents depending only on (sequence, position, seed).
struct MlaCall {
  Case c;
  int64_t block_size = 0, max_blocks = 0, num_blocks = 0, tokens = 0;
  std::vector<float> q;
  std::vector<uint16_t> cache, kv_b;
  std::vector<int32_t> seq_lens, query_start, tables;
  // The cache and W start this many elements into their vectors (an unaligned
  // device cache in the UnalignedCacheRunsTheSimtKernels test).
  int64_t offset = 0;

  MlaArgs Args(float* out) const {
    MlaArgs a;
    a.heads = c.heads;
    a.nope_dim = c.nope;
    a.rope_dim = c.rope;
    a.v_dim = c.v;
    a.kv_lora_rank = c.lora;
    a.scale = 1.0f / std::sqrt(static_cast<float>(c.nope + c.rope));
    a.num_seqs = static_cast<int64_t>(c.ctx.size());
    a.num_tokens = tokens;
    a.seq_lens = seq_lens.data();
    a.query_start = query_start.data();
    a.block_tables = tables.data();
    a.block_table_stride = max_blocks;
    a.kv_cache = cache.data() + offset;
    a.num_blocks = num_blocks;
    a.block_size = block_size;
    a.kv_b_proj = kv_b.data() + offset;
    a.q = q.data();
    a.ld_q = c.heads * (c.nope + c.rope);
    a.out = out;
    a.ld_out = c.heads * c.v;
    return a;
  }
};

MlaCall Make(const Case& c, int64_t block_size, uint32_t seed) {
  MlaCall s;
  s.c = c;
  s.block_size = block_size;
  const int64_t width = c.lora + c.rope, seqs = static_cast<int64_t>(c.ctx.size());
  int64_t total = 1;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t b = (c.ctx[i] + block_size - 1) / block_size;
    s.max_blocks = std::max(s.max_blocks, b);
    total += b;
    s.tokens += c.q_len[i];
  }
  s.num_blocks = total;
  std::vector<int32_t> ids(total - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed + 1));
  s.tables.assign(seqs * s.max_blocks, -1);
  s.cache.assign(total * block_size * width, 0xffff);  // NaN where nothing is cached
  s.query_start.push_back(0);
  int64_t next = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    s.seq_lens.push_back(c.ctx[i]);
    s.query_start.push_back(s.query_start.back() + c.q_len[i]);
    const int64_t b = (c.ctx[i] + block_size - 1) / block_size;
    for (int64_t j = 0; j < b; ++j) s.tables[i * s.max_blocks + j] = ids[next++];
    std::mt19937 lr(seed * 7 + i);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    for (int64_t p = 0; p < c.ctx[i]; ++p) {
      const int64_t slot =
          s.tables[i * s.max_blocks + p / block_size] * block_size + p % block_size;
      for (int64_t d = 0; d < width; ++d)
        s.cache[slot * width + d] = F32ToBf16(n01(lr));
    }
  }
  std::mt19937 qr(seed * 13);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  s.q.resize(s.tokens * c.heads * (c.nope + c.rope));
  for (float& x : s.q) x = n01(qr);
  std::mt19937 wr(seed * 17);
  std::normal_distribution<float> nw(0.0f, 0.3f / std::sqrt(8.0f));
  s.kv_b.resize(c.heads * (c.nope + c.v) * c.lora);
  for (uint16_t& x : s.kv_b) x = F32ToBf16(nw(wr));
  return s;
}

MlaLaunchArgs ToLaunch(const MlaArgs& m, int32_t* error_word) {
  MlaLaunchArgs a;
  a.heads = m.heads;
  a.nope = m.nope_dim;
  a.rope = m.rope_dim;
  a.v = m.v_dim;
  a.lora = m.kv_lora_rank;
  a.scale = m.scale;
  a.num_seqs = m.num_seqs;
  a.num_tokens = m.num_tokens;
  a.seq_lens = m.seq_lens;
  a.query_start = m.query_start;
  a.block_tables = m.block_tables;
  a.block_table_stride = m.block_table_stride;
  a.kv_cache = m.kv_cache;
  a.num_blocks = m.num_blocks;
  a.block_size = m.block_size;
  a.kv_b_proj = m.kv_b_proj;
  a.q = m.q;
  a.ld_q = m.ld_q;
  a.out = m.out;
  a.ld_out = m.ld_out;
  a.error_word = error_word;
  return a;
}

std::vector<float> Oracle(const MlaCall& s) {
  std::vector<float> out(s.tokens * s.c.heads * s.c.v, 0.0f);
  auto ref = CreateReferenceBackend();
  EXPECT_TRUE(ref->MlaAttentionExpanded(s.Args(out.data())).ok());
  return out;
}

// splits <= 0: MlaAbsorbedSplits for 132 SMs.
std::vector<float> Absorbed(const MlaCall& s, int splits, int32_t* error = nullptr,
                            MlaCore core = MlaCore::kAuto, int row_groups = 0,
                            bool bf16_operands = false) {
  std::vector<float> out(s.tokens * s.c.heads * s.c.v, -7.0f);
  int32_t word = 0;
  MlaLaunchArgs a = ToLaunch(s.Args(out.data()), &word);
  a.row_groups = row_groups;
  if (splits <= 0) splits = MlaAbsorbedSplits(a, 132);
  std::vector<char> scratch(MlaAbsorbedScratchBytes(a, splits) + 256);
  const char* e =
      MlaAbsorbedLaunch(a, splits, scratch.data(), nullptr, core, bf16_operands);
  EXPECT_EQ(e, nullptr) << e;
  if (error != nullptr) {
    *error = word;
  } else {
    EXPECT_EQ(word, kDeviceOk);
  }
  return out;
}

// chunk <= 0: MlaExpandedChunk for a 256 MiB budget.
std::vector<float> Expanded(const MlaCall& s, int64_t chunk, int32_t* error = nullptr,
                            MlaCore core = MlaCore::kAuto, int64_t max_context = 0,
                            bool bf16_operands = false) {
  std::vector<float> out(s.tokens * s.c.heads * s.c.v, -7.0f);
  int32_t word = 0;
  MlaLaunchArgs a = ToLaunch(s.Args(out.data()), &word);
  a.max_context = max_context;
  if (chunk <= 0) chunk = MlaExpandedChunk(a, size_t{256} << 20);
  std::vector<char> scratch(MlaExpandedScratchBytes(a, chunk) + 256);
  const char* e =
      MlaExpandedLaunch(a, chunk, scratch.data(), nullptr, core, bf16_operands);
  EXPECT_EQ(e, nullptr) << e;
  if (error != nullptr) {
    *error = word;
  } else {
    EXPECT_EQ(word, kDeviceOk);
  }
  return out;
}

// max |got - want| / max |want|.
double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double mx = 1e-20, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    mx = std::max(mx, static_cast<double>(std::fabs(want[i])));
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(got[i])) {
      err = INFINITY;
    } else {
      err = std::max(err, d);
    }
  }
  return err / mx;
}

constexpr double kBound = 2e-5;

constexpr MlaCore kCores[] = {MlaCore::kSimt, MlaCore::kTensorCore};

const char* CoreName(MlaCore core) {
  return core == MlaCore::kSimt         ? "simt"
         : core == MlaCore::kTensorCore ? "mma"
                                        : "auto";
}

void ExpectWithin(const std::vector<float>& got, const std::vector<float>& want,
                  double bound, const std::string& what) {
  const double err = RelErr(got, want);
  std::printf("  %-44s %.3g of max|want|\n", what.c_str(), err);
  EXPECT_LE(err, bound) << what;
}

TEST(MlaKernels, OddDimsPagedMixedSequences) {
  // decode (q=1), prefill chunk with prefix (q=5), q == ctx (q=9), one long one.
  const Case c{3, 16, 8, 12, 64, {1, 37, 300, 9}, {1, 5, 1, 9}};
  for (int64_t bs : {1, 16, 64}) {
    const MlaCall s = Make(c, bs, 5);
    const std::vector<float> want = Oracle(s);
    const std::string what = "block " + std::to_string(bs);
    const std::vector<float> exp = Expanded(s, 0);
    ExpectWithin(exp, want, kBound, std::string("expanded ") + what);
    for (MlaCore core : kCores) {
      const std::vector<float> abs = Absorbed(s, 0, nullptr, core);
      ExpectWithin(abs, want, kBound,
                   std::string("absorbed ") + CoreName(core) + " " + what);
      ExpectWithin(abs, exp, kBound,
                   std::string("absorbed vs expanded ") + CoreName(core) + " " + what);
    }
  }
}

TEST(MlaKernels, LatentNotAMultipleOf32RunsSimt) {
  const Case c{2, 8, 6, 8, 48, {21, 4}, {3, 4}};
  const MlaCall s = Make(c, 16, 8);
  const std::vector<float> want = Oracle(s);
  ExpectWithin(Absorbed(s, 0), want, kBound, "absorbed lora 48 (auto: simt)");
  ExpectWithin(Expanded(s, 0), want, kBound, "expanded lora 48");
}

TEST(MlaKernels, SplitsAndChunksDoNotChangeTheResult) {
  // (also a 150-query prefill: several query tiles of one sequence, causal, and
  // a sequence without queries)
  const Case c{2, 16, 16, 16, 32, {200, 65, 3, 150, 7}, {4, 1, 3, 150, 0}};
  const MlaCall s = Make(c, 16, 11);
  const std::vector<float> want = Oracle(s);
  for (MlaCore core : kCores) {
    for (int splits : {1, 2, 3, 7, kMlaMaxSplits}) {
      ExpectWithin(Absorbed(s, splits, nullptr, core), want, kBound,
                   std::string("absorbed ") + CoreName(core) + " splits " +
                       std::to_string(splits));
    }
  }
  for (int groups : {1, 2, 3}) {  // 16-row groups per block of the mma kernel
    for (int splits : {1, 3}) {
      ExpectWithin(Absorbed(s, splits, nullptr, MlaCore::kTensorCore, groups), want,
                   kBound,
                   "absorbed mma " + std::to_string(groups) + " row groups, splits " +
                       std::to_string(splits));
    }
  }
  for (MlaCore core : kCores) {
    for (int64_t chunk : {64, 128, 256}) {
      ExpectWithin(Expanded(s, chunk, nullptr, core), want, kBound,
                   std::string("expanded ") + CoreName(core) + " chunk " +
                       std::to_string(chunk));
    }
  }
}

// The same call with block tables `factor` times wider (a prompt's table sized
// for its whole prompt, the early chunks of its prefill): the extra entries are
// never read.
MlaCall Widened(const MlaCall& s, int64_t factor) {
  MlaCall w = s;
  w.max_blocks = s.max_blocks * factor;
  w.tables.assign(s.c.ctx.size() * w.max_blocks, 0);
  for (size_t i = 0; i < s.c.ctx.size(); ++i) {
    std::copy_n(s.tables.begin() + i * s.max_blocks, s.max_blocks,
                w.tables.begin() + i * w.max_blocks);
  }
  return w;
}

// The expanded form walks the context up to the longest sequence the caller
// names (MlaArgs::max_context), not to the tables' reach: the same result in a
// fraction of the launches, and a sequence longer than the bound is refused.
TEST(MlaKernels, ExpandedWalksOnlyTheLongestContext) {
  const Case c{2, 16, 16, 16, 32, {200, 65, 3, 150, 7}, {4, 1, 3, 150, 0}};
  const MlaCall s = Make(c, 16, 11);
  const MlaCall wide = Widened(s, 16);  // 3328 positions of reach
  const std::vector<float> want = Oracle(s);
  for (MlaCore core : kCores) {
    const std::vector<float> narrow = Expanded(s, 64, nullptr, core);
    const uint64_t l0 = cuda_sim::GetStats().launches;
    const std::vector<float> unbounded = Expanded(wide, 64, nullptr, core);
    const uint64_t l1 = cuda_sim::GetStats().launches;
    const std::vector<float> bounded = Expanded(wide, 64, nullptr, core, 200);
    const uint64_t l2 = cuda_sim::GetStats().launches;
    ExpectWithin(unbounded, want, kBound, std::string("unbounded ") + CoreName(core));
    EXPECT_EQ(bounded, narrow) << CoreName(core);
    EXPECT_LT(8 * (l2 - l1), l1 - l0) << CoreName(core) << ": 4 chunks instead of 52";
    int32_t err = 0;
    Expanded(wide, 64, &err, core, 199);
    EXPECT_EQ(err, kBadSequenceLength) << CoreName(core);
  }
}

TEST(MlaKernels, K3HeadsPerRankRealDims) {
  // K3 at TP8: 12 heads, nope 128, rope 64, v 128, latent 512 (576 cached), short
  // contexts: a decode, a k = 4 draft verification, a prefill chunk q == ctx.
  const Case c{12, 128, 64, 128, 512, {9, 40, 33}, {1, 4, 33}};
  const MlaCall s = Make(c, 16, 3);
  const std::vector<float> want = Oracle(s);
  const std::vector<float> exp = Expanded(s, 0, nullptr, MlaCore::kSimt);
  ExpectWithin(exp, want, kBound, "K3 expanded simt");
  const std::vector<float> exp_mma = Expanded(s, 0, nullptr, MlaCore::kTensorCore);
  ExpectWithin(exp_mma, want, kBound, "K3 expanded mma");
  ExpectWithin(exp_mma, exp, kBound, "K3 expanded mma vs simt");
  for (MlaCore core : kCores) {
    const std::vector<float> abs = Absorbed(s, 0, nullptr, core);
    ExpectWithin(abs, want, kBound, std::string("K3 absorbed ") + CoreName(core));
    ExpectWithin(abs, exp, kBound,
                 std::string("K3 absorbed vs expanded ") + CoreName(core));
  }
  // The BF16-operand forms ("cuda_bf16"; the Bf16Operands test has the rest).
  const std::vector<float> exp_bf16 =
      Expanded(s, 0, nullptr, MlaCore::kTensorCore, 0, /*bf16_operands=*/true);
  ExpectWithin(exp_bf16, want, 2e-2, "K3 expanded mma bf16");
  EXPECT_GE(RelErr(exp_bf16, want), 1e-4);
  const std::vector<float> abs_bf16 =
      Absorbed(s, 0, nullptr, MlaCore::kTensorCore, 0, /*bf16_operands=*/true);
  ExpectWithin(abs_bf16, want, 2e-2, "K3 absorbed mma bf16");
  EXPECT_GE(RelErr(abs_bf16, want), 1e-4);
  // Split partials merged at K3 width (the small-dims test covers more counts).
  ExpectWithin(Absorbed(s, 3, nullptr, MlaCore::kTensorCore), want, kBound,
               "K3 absorbed 3 splits mma");
  ExpectWithin(Absorbed(s, 0, nullptr, MlaCore::kTensorCore, 1), want, kBound,
               "K3 absorbed mma 1 row group");
}

// "cuda_bf16": the tensor-core kernels round their fp32 operands to BF16 once
// (one mma a product): q, k_nope, v and p (expanded), q and p (absorbed). Their
// error is BF16's (bound 2e-2 of max|out|, as the conformance suite's attention
// bound on the _bf16 backends), and at least 1e-4: the BF16 form is the one that
// ran, not the split one. Chunks, splits, row groups, causal query tiles and
// seeds here; K3's real dims in K3HeadsPerRankRealDims.
TEST(MlaKernels, Bf16Operands) {
  constexpr double kBf16Bound = 2e-2, kBf16Floor = 1e-4;
  {
    const Case c{2, 16, 16, 16, 32, {200, 65, 3, 150, 7}, {4, 1, 3, 150, 0}};
    const MlaCall s = Make(c, 16, 11);
    const std::vector<float> want = Oracle(s);
    double worst = 0;
    for (int64_t chunk : {64, 128, 256}) {
      const std::vector<float> got =
          Expanded(s, chunk, nullptr, MlaCore::kTensorCore, 0, /*bf16_operands=*/true);
      ExpectWithin(got, want, kBf16Bound,
                   "expanded mma bf16 chunk " + std::to_string(chunk));
      worst = std::max(worst, RelErr(got, want));
    }
    EXPECT_GE(worst, kBf16Floor);
    worst = 0;
    for (int groups : {1, 2, 3}) {
      for (int splits : {1, 3, 7}) {
        const std::vector<float> got = Absorbed(
            s, splits, nullptr, MlaCore::kTensorCore, groups, /*bf16_operands=*/true);
        ExpectWithin(got, want, kBf16Bound,
                     "absorbed mma bf16 " + std::to_string(groups) +
                         " row groups, splits " + std::to_string(splits));
        worst = std::max(worst, RelErr(got, want));
      }
    }
    EXPECT_GE(worst, kBf16Floor);
    ExpectWithin(Absorbed(s, 3, nullptr, MlaCore::kSimt, 0, true), want, kBound,
                 "absorbed simt bf16_operands");
    // kAuto picks the tensor-core kernel here; the SIMT kernel stays fp32.
    EXPECT_EQ(Expanded(s, 64, nullptr, MlaCore::kAuto, 0, true),
              Expanded(s, 64, nullptr, MlaCore::kTensorCore, 0, true));
    ExpectWithin(Expanded(s, 64, nullptr, MlaCore::kSimt, 0, true), want, kBound,
                 "expanded simt bf16_operands");
  }
  {
    const Case c{3, 24, 8, 16, 64, {70, 5}, {6, 5}};
    const MlaCall s = Make(c, 16, 21);
    const std::vector<float> want = Oracle(s);
    for (uint64_t seed : {1u, 2u, 3u}) {
      cuda_sim::SetSeed(seed);
      ExpectWithin(Expanded(s, 64, nullptr, MlaCore::kTensorCore, 0, true), want,
                   kBf16Bound, "expanded mma bf16 seed " + std::to_string(seed));
      ExpectWithin(Absorbed(s, 3, nullptr, MlaCore::kTensorCore, 0, true), want,
                   kBf16Bound, "absorbed mma bf16 seed " + std::to_string(seed));
    }
    cuda_sim::SetSeed(1);
  }
  // K3's real dims: in K3HeadsPerRankRealDims (one oracle for both).
}

TEST(MlaKernels, K3LongerContextDecode) {
  // The error of the split-BF16 tensor-core path does not grow with the context:
  // 1000 and 700 cached positions (8 splits), a decode and a 2-draft verification.
  // Oracle: the fp64 absorbed form (the expanded one costs minutes here).
  const Case c{12, 128, 64, 128, 512, {1000, 700}, {1, 2}};
  const MlaCall s = Make(c, 64, 17);
  std::vector<float> want(s.tokens * c.heads * c.v, 0.0f);
  ASSERT_TRUE(CreateReferenceBackend()->MlaAttentionAbsorbed(s.Args(want.data())).ok());
  for (MlaCore core : kCores) {
    ExpectWithin(Absorbed(s, 0, nullptr, core), want, kBound,
                 std::string("K3 ctx 1000/700 absorbed ") + CoreName(core));
  }
}

TEST(MlaKernels, SpeculativeQueriesAreCausal) {
  // Query i of a k = 4 run equals a single-query run whose context ends at it.
  const Case c{2, 16, 16, 16, 32, {40}, {4}};
  const MlaCall s = Make(c, 16, 9);
  const int64_t row = c.heads * c.v;
  for (MlaCore core : kCores) {
    const std::vector<float> all = Absorbed(s, 0, nullptr, core);
    const std::vector<float> all_exp = Expanded(s, 0, nullptr, core);
    for (int32_t i = 0; i < 4; ++i) {
      MlaCall one = Make(c, 16, 9);
      one.seq_lens[0] = 40 - 3 + i;
      one.query_start = {0, 1};
      one.tokens = 1;
      one.q.assign(s.q.begin() + i * c.heads * (c.nope + c.rope),
                   s.q.begin() + (i + 1) * c.heads * (c.nope + c.rope));
      const std::vector<float> want(all.begin() + i * row, all.begin() + (i + 1) * row);
      ExpectWithin(
          Absorbed(one, 0, nullptr, core), want, 1e-6,
          std::string("absorbed ") + CoreName(core) + " draft " + std::to_string(i));
      const std::vector<float> want_exp(all_exp.begin() + i * row,
                                        all_exp.begin() + (i + 1) * row);
      ExpectWithin(
          Expanded(one, 0, nullptr, core), want_exp, 1e-6,
          std::string("expanded ") + CoreName(core) + " draft " + std::to_string(i));
    }
  }
}

// A cache 4 bytes off 16-byte alignment, as a caller's sub-buffer could be: the
// tensor-core flash and absorbed kernels copy 16-byte pieces (cp.async faults on
// a GPU; the emulator faults too), so the SIMT kernels run it, with the same
// result. 2 bytes off, every kernel's 32-bit reads would fault: refused.
TEST(MlaKernels, UnalignedCacheRunsTheSimtKernelsOrIsRefused) {
  const Case c{2, 16, 16, 16, 32, {70, 5}, {6, 5}};
  const MlaCall s = Make(c, 16, 21);
  MlaCall u = s;
  u.offset = 2;
  u.cache.insert(u.cache.begin(), 2, 0);
  u.kv_b.insert(u.kv_b.begin(), 2, 0);
  const std::vector<float> want = Oracle(s);
  ExpectWithin(Expanded(u, 64), want, kBound, "expanded, cache 4 bytes off");
  ExpectWithin(Absorbed(u, 3), want, kBound, "absorbed, cache 4 bytes off");
  ExpectWithin(Expanded(u, 64, nullptr, MlaCore::kAuto, 0, /*bf16_operands=*/true),
               want, kBound, "expanded bf16_operands, cache 4 bytes off (SIMT: fp32)");
  MlaCall odd = s;
  odd.offset = 1;
  odd.cache.insert(odd.cache.begin(), 0);
  odd.kv_b.insert(odd.kv_b.begin(), 0);
  std::vector<float> out(s.tokens * c.heads * c.v);
  int32_t word = 0;
  const MlaLaunchArgs a = ToLaunch(odd.Args(out.data()), &word);
  const char* why = MlaUnsupported(a, /*absorbed=*/true);
  ASSERT_NE(why, nullptr);
  EXPECT_NE(std::string(why).find("4-byte aligned"), std::string::npos) << why;
  EXPECT_NE(MlaUnsupported(a, /*absorbed=*/false), nullptr);
}

TEST(MlaKernels, EmulatorSeeds) {
  // Races between warps show up as seed-dependent results.
  const Case c{3, 24, 8, 16, 64, {70, 5}, {6, 5}};
  const MlaCall s = Make(c, 16, 21);
  const std::vector<float> want = Oracle(s);
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    cuda_sim::SetSeed(seed);
    for (MlaCore core : kCores) {
      ExpectWithin(
          Absorbed(s, 3, nullptr, core), want, kBound,
          std::string("absorbed ") + CoreName(core) + " seed " + std::to_string(seed));
      ExpectWithin(
          Expanded(s, 64, nullptr, core), want, kBound,
          std::string("expanded ") + CoreName(core) + " seed " + std::to_string(seed));
    }
  }
  cuda_sim::SetSeed(1);
}

TEST(MlaKernels, RecordsBadBlockIdsAndLengths) {
  const Case c{1, 8, 8, 8, 32, {20}, {1}};
  {
    MlaCall s = Make(c, 8, 3);
    s.tables[1] = static_cast<int32_t>(s.num_blocks);
    int32_t err = -1;
    Absorbed(s, 0, &err);
    EXPECT_EQ(err, kBlockIdOutOfRange);
    Expanded(s, 0, &err);
    EXPECT_EQ(err, kBlockIdOutOfRange);
    s.tables[1] = -3;
    for (MlaCore core : kCores) {
      err = -1;
      Absorbed(s, 0, &err, core);
      EXPECT_EQ(err, kBlockIdOutOfRange) << CoreName(core);
    }
  }
  {
    MlaCall s = Make(c, 8, 3);
    s.seq_lens[0] = 100;  // needs more blocks than the table holds
    int32_t err = -1;
    Absorbed(s, 0, &err);
    EXPECT_EQ(err, kBlockIdOutOfRange);
    Expanded(s, 0, &err);
    EXPECT_EQ(err, kBlockIdOutOfRange);
  }
  {
    MlaCall s = Make(Case{1, 8, 8, 8, 32, {20}, {2}}, 8, 3);
    s.seq_lens[0] = 1;  // two queries, one position of context
    int32_t err = -1;
    Absorbed(s, 0, &err);
    EXPECT_EQ(err, kBadSequenceLength);
    Expanded(s, 0, &err);
    EXPECT_EQ(err, kBadSequenceLength);
  }
  {
    MlaCall s = Make(c, 8, 3);
    s.query_start = {0, 1};
    s.seq_lens[0] = 0;  // a query but no context
    int32_t err = -1;
    Expanded(s, 0, &err);
    EXPECT_EQ(err, kBadSequenceLength);
    // The absorbed form takes it as padding (CUDA-graph batches): zero rows.
    for (MlaCore core : kCores) {
      err = -1;
      std::vector<float> out = Absorbed(s, 0, &err, core);
      EXPECT_EQ(err, kDeviceOk) << CoreName(core);
      ASSERT_FALSE(out.empty());
      for (float v : out) ASSERT_EQ(v, 0.0f) << CoreName(core);
    }
  }
}

TEST(MlaKernels, SplitCountFromHostValues) {
  MlaLaunchArgs a;
  a.heads = 12;
  a.nope = 128;
  a.rope = 64;
  a.v = 128;
  a.lora = 512;
  a.block_size = 64;
  a.block_table_stride = 2048;  // 128k positions
  auto splits = [&](int64_t seqs, int64_t tokens) {
    a.num_seqs = seqs;
    a.num_tokens = tokens;
    return MlaAbsorbedSplits(a, 132);
  };
  EXPECT_EQ(splits(1, 1), kMlaMaxSplits);
  EXPECT_EQ(splits(16, 16), 8);
  EXPECT_EQ(splits(64, 64), 2);
  EXPECT_EQ(splits(100, 100), 1);
  EXPECT_EQ(splits(4, 16), 33);  // 4 drafts each: 48 rows, one 3-group tile each
  a.block_table_stride = 4;      // 256 positions: splits of >= 128
  EXPECT_EQ(splits(1, 1), 2);
}

TEST(MlaKernels, UnsupportedShapesAreRefused) {
  MlaLaunchArgs a;
  a.heads = 1;
  a.nope = 8;
  a.rope = 8;
  a.v = 8;
  a.lora = 1024;
  EXPECT_NE(MlaUnsupported(a, true), nullptr);
  a.lora = 512;
  EXPECT_EQ(MlaUnsupported(a, true), nullptr);
  a.v = 256;
  EXPECT_NE(MlaUnsupported(a, false), nullptr);
  EXPECT_EQ(MlaUnsupported(a, true), nullptr);
}

}  // namespace
}  // namespace tandem::kernels::cuda
