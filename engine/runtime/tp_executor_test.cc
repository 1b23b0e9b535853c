// The TP executor on the tiny checkpoint: TP 2 and 4 (and TP 8 on a generated
// 8-head variant, since the tiny config's 4 heads refuse 8) against TP 1 —
// logits within tolerance, identical greedy tokens; the slot fan-out; a failing
// rank fails the step within the communicator timeout and breaks the executor.
#include "engine/runtime/tp_executor.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/time/clock.h"
#include "common/status.h"
#include "engine/model/make_checkpoint.h"
#include "engine/runtime/shard_dims.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "parallel/sharding.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::MakePrompt;

// Logits of TP N vs TP 1 on the "cpu" backend (fp32 activations): the ranks'
// partial sums are added in another order (per-rank GEMM over k/N, then the
// all-reduce), so only fp32 rounding differs: ~1e-6 of the logit scale per
// reduction, grown through 8 layers and the MoE mixers. The bound is 1e-3 of
// the TP 1 logits' standard deviation (measured on these prompts: 5e-6 to
// 1.1e-4, TP 2/4/8); a wrong split (a head or a vocab slice misplaced, a missing
// reduction) moves logits by O(1) of it.
constexpr double kTpRelTol = 1e-3;

const model::Checkpoint& Tiny() {
  static const model::Checkpoint* c = [] {
    auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
    if (!ckpt.ok()) std::abort();
    return ckpt->release();
  }();
  return *c;
}

TpExecutorOptions Options(int tp) {
  TpExecutorOptions o;
  o.tp_size = tp;
  o.backend = "cpu";
  o.threads_per_rank = 1;
  o.cache.num_blocks = 64;
  o.cache.block_size = 16;
  o.cache.num_slots = 4;
  o.timeout = absl::Seconds(20);
  return o;
}

std::unique_ptr<TpExecutor> Make(const model::Checkpoint& ckpt, int tp) {
  auto ex = TpExecutor::Create(ckpt, Options(tp));
  EXPECT_TRUE(ex.ok()) << ex.status();
  return ex.ok() ? *std::move(ex) : nullptr;
}

struct Run {
  std::vector<std::vector<float>> logits;  // per forward: the last token's row
  std::vector<int32_t> tokens;             // greedy continuation
};

// Prefill `prompt` in chunks of 13 on slot `slot`, then `steps` greedy tokens.
absl::StatusOr<Run> Generate(TpExecutor* ex, const std::vector<int32_t>& prompt,
                             int64_t slot, int steps) {
  const int64_t V = ex->weights(0).config.text.vocab_size;
  const std::vector<int32_t> blocks = BlockRange(slot * 16, 16);
  TANDEM_RETURN_IF_ERROR(ex->ResetSlot(slot));
  Run run;
  int64_t pos = 0;
  std::vector<float> logits;
  auto feed = [&](absl::Span<const int32_t> toks) -> absl::Status {
    SequenceInput in;
    in.tokens = toks;
    in.start_pos = pos;
    in.block_table = blocks;
    in.kda_slot = slot;
    in.logits_indices = {static_cast<int32_t>(toks.size()) - 1};
    TANDEM_RETURN_IF_ERROR(ex->Forward({&in, 1}, &logits));
    pos += toks.size();
    run.logits.push_back(logits);
    return absl::OkStatus();
  };
  for (size_t i = 0; i < prompt.size(); i += 13) {
    TANDEM_RETURN_IF_ERROR(feed(absl::MakeConstSpan(prompt).subspan(
        i, std::min<size_t>(13, prompt.size() - i))));
  }
  for (int s = 0; s < steps; ++s) {
    run.tokens.push_back(Argmax(absl::MakeConstSpan(logits).subspan(0, V)));
    TANDEM_RETURN_IF_ERROR(feed({&run.tokens.back(), 1}));
  }
  return run;
}

// max |a - b| / std(a) over all rows.
double RelDiff(const std::vector<std::vector<float>>& a,
               const std::vector<std::vector<float>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].size(), b[i].size());
    double sum = 0, sq = 0, m = 0;
    for (size_t j = 0; j < a[i].size(); ++j) {
      sum += a[i][j];
      sq += static_cast<double>(a[i][j]) * a[i][j];
      m = std::max(m, std::fabs(static_cast<double>(a[i][j]) - b[i][j]));
    }
    const double n = a[i].size();
    const double sd = std::sqrt(sq / n - (sum / n) * (sum / n));
    worst = std::max(worst, m / sd);
  }
  return worst;
}

const std::vector<std::vector<int32_t>>& Prompts() {
  static const auto* p = new std::vector<std::vector<int32_t>>{
      MakePrompt(5, 1), MakePrompt(21, 2), MakePrompt(40, 3)};
  return *p;
}

void ExpectMatchesTp1(const model::Checkpoint& ckpt, int tp, int steps) {
  auto one = Make(ckpt, 1);
  auto many = Make(ckpt, tp);
  ASSERT_TRUE(one && many);
  ASSERT_EQ(many->tp_size(), tp);
  for (size_t p = 0; p < Prompts().size(); ++p) {
    auto want = Generate(one.get(), Prompts()[p], p % 4, steps);
    auto got = Generate(many.get(), Prompts()[p], p % 4, steps);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, want->tokens) << "TP " << tp << " prompt " << p;
    const double rel = RelDiff(want->logits, got->logits);
    EXPECT_LT(rel, kTpRelTol) << "TP " << tp << " prompt " << p;
    ::testing::Test::RecordProperty(
        "tp" + std::to_string(tp) + "_p" + std::to_string(p) + "_rel",
        std::to_string(rel));
  }
  // Communication happened, and only on the TP group.
  EXPECT_GT(many->comm_stats().calls, 0);
  EXPECT_EQ(one->comm_stats().calls, 0);
}

TEST(TpExecutorTest, Tp2MatchesTp1) { ExpectMatchesTp1(Tiny(), 2, 6); }
TEST(TpExecutorTest, Tp4MatchesTp1) { ExpectMatchesTp1(Tiny(), 4, 6); }

// TP 8 needs 8 KDA and MLA heads: the tiny config with 8 heads of half the
// width (same projection sizes), generated into the test's temp dir.
TEST(TpExecutorTest, Tp8MatchesTp1OnAnEightHeadVariant) {
  model::ModelConfig c = model::TinyConfig();
  c.text.linear_attn_config.num_heads = 8;
  c.text.linear_attn_config.head_dim = 8;
  c.text.num_attention_heads = 8;
  c.text.num_key_value_heads = 8;
  ASSERT_TRUE(parallel::CheckTpSize(ShardDimsOf(c), 8).ok());
  const char* tmp = std::getenv("TEST_TMPDIR");
  model::MakeCheckpointOptions mo;
  mo.out_dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/tiny8";
  mo.config = c;
  mo.seed = 7;
  mo.num_shards = 1;
  mo.num_threads = 2;
  ASSERT_TRUE(model::MakeCheckpoint(mo).ok());
  auto ckpt = model::Checkpoint::Open(mo.out_dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ExpectMatchesTp1(**ckpt, 8, 4);
}

TEST(TpExecutorTest, RefusesSizesTheConfigDoesNotDivide) {
  auto ex = TpExecutor::Create(Tiny(), Options(8));
  ASSERT_FALSE(ex.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(ex.status()));
  EXPECT_NE(ex.status().message().find("linear_attn_config.num_heads = 4"),
            std::string::npos)
      << ex.status();
  EXPECT_FALSE(TpExecutor::Create(Tiny(), Options(3)).ok());
}

// Snapshots cover every rank; exported ranges are rank-major with their rank;
// CopySlot moves every rank's heads.
TEST(TpExecutorTest, SlotOperationsCoverEveryRank) {
  auto ex = Make(Tiny(), 2);
  ASSERT_TRUE(ex);
  const std::vector<int32_t>& prompt = Prompts()[1];
  auto base = Generate(ex.get(), prompt, 0, 1);
  ASSERT_TRUE(base.ok());
  auto snap = ex->SnapshotSlot(0);
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->values.size() * sizeof(float),
            ex->cache(0).kda_bytes_per_slot() + ex->cache(1).kda_bytes_per_slot());
  ASSERT_TRUE(ex->CopySlot(0, 2).ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(0, std::memcmp(ex->cache(r).kda_recurrent(0, 0),
                             ex->cache(r).kda_recurrent(2, 0),
                             ex->cache(r).kda_bytes_per_slot()));
  }
  ASSERT_TRUE(ex->ResetSlot(0).ok());
  EXPECT_EQ(ex->cache(1).kda_recurrent(0, 0)[0], 0.0f);
  ASSERT_TRUE(ex->RestoreSlot(0, *snap).ok());
  auto again = ex->SnapshotSlot(0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->values, snap->values);
  KdaSnapshot half;
  half.values.assign(snap->values.begin(), snap->values.begin() + 10);
  EXPECT_FALSE(ex->RestoreSlot(0, half).ok());

  const int64_t n = static_cast<int64_t>(prompt.size()) + 1;
  auto ranges = ex->ExportSequence(BlockRange(0, 16), n, 0);
  ASSERT_TRUE(ranges.ok());
  ASSERT_FALSE(ranges->empty());
  EXPECT_EQ(ranges->front().rank, 0);
  EXPECT_EQ(ranges->back().rank, 1);
  int prev = 0;
  for (const StateRange& r : *ranges) {
    EXPECT_GE(r.rank, prev);
    prev = r.rank;
  }
  // The MLA latent cache is replicated: both ranks hold the same bytes.
  size_t mla_bytes[2] = {0, 0};
  for (const StateRange& r : *ranges) {
    if (r.kind == StateKind::kMla) mla_bytes[r.rank] += r.bytes;
  }
  EXPECT_EQ(mla_bytes[0], mla_bytes[1]);
  EXPECT_GT(mla_bytes[0], 0u);
  for (int m = 0; m < ex->cache(0).num_mla_layers(); ++m) {
    EXPECT_EQ(0, std::memcmp(ex->cache(0).mla_layer(m), ex->cache(1).mla_layer(m),
                             ex->cache(0).mla_layer_bytes()))
        << "MLA layer " << m;
  }
}

// Rank 1's thread ends at the third Forward: that Forward fails within the
// communicator timeout naming rank 1, and every later call fails at once.
TEST(TpExecutorTest, RankFailureFailsTheStepAndBreaksTheExecutor) {
  TpExecutorOptions o = Options(4);
  o.timeout = absl::Seconds(5);
  o.fail_rank = 1;
  o.fail_rank_at_step = 2;
  auto ex = TpExecutor::Create(Tiny(), o);
  ASSERT_TRUE(ex.ok()) << ex.status();
  const std::vector<int32_t> blocks = BlockRange(0, 4);
  const std::vector<int32_t> toks = MakePrompt(8, 9);
  std::vector<float> logits;
  for (int step = 0; step < 2; ++step) {
    SequenceInput in;
    in.tokens = absl::MakeConstSpan(toks).subspan(step * 4, 4);
    in.start_pos = step * 4;
    in.block_table = blocks;
    in.logits_indices = {3};
    ASSERT_TRUE((*ex)->Forward({&in, 1}, &logits).ok());
  }
  SequenceInput in;
  in.tokens = absl::MakeConstSpan(toks).subspan(0, 1);
  in.start_pos = 8;
  in.block_table = blocks;
  in.logits_indices = {0};
  const absl::Time t0 = absl::Now();
  absl::Status s = (*ex)->Forward({&in, 1}, &logits);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("injected failure"), std::string::npos) << s;
  EXPECT_LT(took, o.timeout + absl::Seconds(5));
  EXPECT_FALSE((*ex)->health().ok());

  const absl::Time t1 = absl::Now();
  absl::Status later = (*ex)->Forward({&in, 1}, &logits);
  EXPECT_TRUE(absl::IsUnavailable(later)) << later;
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later;
  EXPECT_LT(absl::Now() - t1, absl::Seconds(1));
  EXPECT_FALSE((*ex)->ResetSlot(0).ok());
  EXPECT_FALSE((*ex)->ExportSequence(blocks, 8, 0).ok());
}

// An invalid batch is refused by every rank before any collective: reported as
// is, and the group stays usable.
TEST(TpExecutorTest, InvalidInputDoesNotBreakTheGroup) {
  auto ex = Make(Tiny(), 2);
  ASSERT_TRUE(ex);
  const std::vector<int32_t> blocks = BlockRange(0, 1);
  const std::vector<int32_t> toks = MakePrompt(4, 4);
  SequenceInput in;
  in.tokens = toks;
  in.block_table = blocks;
  in.kda_slot = 99;  // out of range
  std::vector<float> logits;
  absl::Status s = ex->Forward({&in, 1}, &logits);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  in.kda_slot = 0;
  in.logits_indices = {3};
  EXPECT_TRUE(ex->Forward({&in, 1}, &logits).ok());
  EXPECT_TRUE(ex->health().ok());
}

// On a device backend the cache is the device's memory (what a worker then
// registers with its transfer agent as such); a cache allocator, which hands out
// host memory, is refused there with a message saying why.
TEST(TpExecutorTest, DeviceBackendCacheComesFromTheDevice) {
  auto backend = testing::MakeBackend("cuda_sim");
  auto weights = testing::TinyWeightsOn(*backend);
  KvCacheOptions co;
  co.num_blocks = 4;
  co.block_size = 16;
  co.num_slots = 1;
  auto ex = TpExecutor::CreateLocal(weights.get(), backend.get(), co, {});
  ASSERT_TRUE(ex.ok()) << ex.status();
  KvCache& cache = (*ex)->cache(0);
  EXPECT_EQ(cache.options().device, &backend->device());
  EXPECT_TRUE(backend->device().Owns(cache.mla_layer(0), cache.mla_layer_bytes()));
  EXPECT_TRUE(
      backend->device().Owns(cache.kda_recurrent(0, 0), cache.kda_bytes_per_slot()));

  co.allocator.allocate = [](size_t n) -> absl::StatusOr<void*> {
    return std::aligned_alloc(64, (n + 63) / 64 * 64);
  };
  co.allocator.release = [](void* p) { std::free(p); };
  auto refused = TpExecutor::CreateLocal(weights.get(), backend.get(), co, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("host memory"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("cuda_sim"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace tandem::engine
