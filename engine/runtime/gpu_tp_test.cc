// Tensor parallelism on the GPU backends, per backend: "cuda_sim" in the default
// build (every rank an emulated device of its own, ranks joined by Gloo: the
// emulated device memory is host memory), "cuda" in --config=cuda builds where
// GPUs are visible (rank r on GPU r, ranks joined by NCCL on the compute stream).
//
//   - TP 1 on the backend gives the CPU backend's greedy tokens (the executor's
//     device path at TP 1: weights, cache and runner on the backend's device);
//   - TP 2 on the backend gives TP 1's greedy tokens on the same backend, logits
//     within the CPU TP tolerance (tp_executor_test.cc: 1e-3 of the TP 1 logits'
//     standard deviation: the ranks' partial sums are added in another order,
//     the rest is the same arithmetic; measured on cuda_sim 1.7e-4 and 5.0e-4,
//     above the CPU's 1.1e-4 because the split-BF16 tensor-core products round
//     per k-slice);
//   - TP 2 decode steps as CUDA graphs (collectives inside) equal the eager TP 2
//     steps bit for bit; a rank that stops during a replay fails the step; a
//     rank too full for a graph's buffers makes the step eager on every rank;
//   - the rank-failure drill (rank 1 stops at a chosen step): that step fails
//     with UNAVAILABLE naming rank 1 within a deadline, every later call fails at
//     once; through the Engine as the worker's --tp_fail_rank_at_step does.
// TP 2 on "cuda" needs two GPUs (NCCL refuses two ranks on one GPU): skipped
// with the visible GPU count otherwise. The emulator is slow: two short prompts,
// three greedy tokens.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/status.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/runtime/tp_executor.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::MakePrompt;

constexpr double kTpRelTol = 1e-3;  // as tp_executor_test.cc
constexpr int kSteps = 3;

const model::Checkpoint& Tiny() {
  static const model::Checkpoint* c = [] {
    auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
    if (!ckpt.ok()) std::abort();
    return ckpt->release();
  }();
  return *c;
}

// GPUs the "cuda" backend can open (0 where this binary has no CUDA).
int VisibleGpus() {
  static const int n = [] {
    int k = 0;
    while (k < 16 && kernels::CreateBackend("cuda", k).ok()) ++k;
    return k;
  }();
  return n;
}

std::vector<std::string> GpuBackends() {
  std::vector<std::string> names;
  if (kernels::CreateBackend("cuda_sim").ok()) names.push_back("cuda_sim");
  if (VisibleGpus() > 0) names.push_back("cuda");
  return names;
}

// How many ranks `backend` can hold: cuda_sim any, cuda one per GPU.
int MaxRanks(const std::string& backend) {
  return backend == "cuda" ? VisibleGpus() : 1 << 20;
}

TpExecutorOptions Options(int tp, const std::string& backend) {
  TpExecutorOptions o;
  o.tp_size = tp;
  o.backend = backend;
  o.threads_per_rank = 1;
  o.cache.num_blocks = 16;
  o.cache.block_size = 16;
  o.cache.num_slots = 2;
  o.timeout = absl::Seconds(20);
  return o;
}

struct Run {
  std::vector<std::vector<float>> logits;  // per forward: the last token's row
  std::vector<int32_t> tokens;             // greedy continuation
};

// Prefill `prompt` in chunks of 7 on slot 0, then kSteps greedy tokens.
absl::StatusOr<Run> Generate(TpExecutor* ex, const std::vector<int32_t>& prompt) {
  const int64_t V = ex->weights(0).config.text.vocab_size;
  const std::vector<int32_t> blocks = BlockRange(0, 4);
  TANDEM_RETURN_IF_ERROR(ex->ResetSlot(0));
  Run run;
  int64_t pos = 0;
  std::vector<float> logits;
  auto feed = [&](absl::Span<const int32_t> toks) -> absl::Status {
    SequenceInput in;
    in.tokens = toks;
    in.start_pos = pos;
    in.block_table = blocks;
    in.kda_slot = 0;
    in.logits_indices = {static_cast<int32_t>(toks.size()) - 1};
    TANDEM_RETURN_IF_ERROR(ex->Forward({&in, 1}, &logits));
    pos += toks.size();
    run.logits.push_back(logits);
    return absl::OkStatus();
  };
  for (size_t i = 0; i < prompt.size(); i += 7) {
    TANDEM_RETURN_IF_ERROR(feed(absl::MakeConstSpan(prompt).subspan(
        i, std::min<size_t>(7, prompt.size() - i))));
  }
  for (int s = 0; s < kSteps; ++s) {
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
    for (size_t j = 0; j < a[i].size() && j < b[i].size(); ++j) {
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
  static const auto* p =
      new std::vector<std::vector<int32_t>>{MakePrompt(5, 11), MakePrompt(16, 12)};
  return *p;
}

std::unique_ptr<TpExecutor> Make(const TpExecutorOptions& o) {
  auto ex = TpExecutor::Create(Tiny(), o);
  EXPECT_TRUE(ex.ok()) << ex.status();
  return ex.ok() ? *std::move(ex) : nullptr;
}

class GpuTp : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuTp, Tp1OnTheDeviceGivesTheCpuTokens) {
  auto cpu = Make(Options(1, "cpu"));
  auto dev = Make(Options(1, GetParam()));
  ASSERT_TRUE(cpu && dev);
  EXPECT_NE(dev->backend(0).device().name(), "host");
  for (size_t p = 0; p < Prompts().size(); ++p) {
    auto want = Generate(cpu.get(), Prompts()[p]);
    auto got = Generate(dev.get(), Prompts()[p]);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, want->tokens) << GetParam() << " prompt " << p;
  }
}

TEST_P(GpuTp, Tp2MatchesTp1) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "TP 2 on " << GetParam() << " needs 2 GPUs, " << VisibleGpus()
                 << " visible (NCCL refuses two ranks on one GPU)";
  }
  auto one = Make(Options(1, GetParam()));
  auto two = Make(Options(2, GetParam()));
  ASSERT_TRUE(one && two);
  ASSERT_EQ(two->tp_size(), 2);
  // Each rank on a device of its own.
  EXPECT_NE(&two->backend(0).device(), &two->backend(1).device());
  for (size_t p = 0; p < Prompts().size(); ++p) {
    auto want = Generate(one.get(), Prompts()[p]);
    auto got = Generate(two.get(), Prompts()[p]);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, want->tokens) << GetParam() << " prompt " << p;
    const double rel = RelDiff(want->logits, got->logits);
    EXPECT_LT(rel, kTpRelTol) << GetParam() << " prompt " << p;
    ::testing::Test::RecordProperty(GetParam() + "_tp2_p" + std::to_string(p) + "_rel",
                                    std::to_string(rel));
  }
  EXPECT_GT(two->comm_stats().calls, 0);
}

// Decode steps under TP run as CUDA graphs with their collectives inside
// (NCCL enqueued on the compute stream; on cuda_sim Gloo as host functions in
// stream order), one bounded wait per step: every rank captures and replays,
// and the logits equal the eager TP 2 steps' bit for bit (the same kernels, the
// same split-KV plan, the same collectives).
TEST_P(GpuTp, Tp2DecodeGraphsEqualEagerSteps) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "TP 2 on " << GetParam() << " needs 2 GPUs, " << VisibleGpus()
                 << " visible";
  }
  TpExecutorOptions eager_options = Options(2, GetParam());
  eager_options.runner.enforce_eager = true;
  auto graphs = Make(Options(2, GetParam()));
  auto eager = Make(eager_options);
  ASSERT_TRUE(graphs && eager);
  for (size_t p = 0; p < Prompts().size(); ++p) {
    auto want = Generate(eager.get(), Prompts()[p]);
    auto got = Generate(graphs.get(), Prompts()[p]);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, want->tokens) << GetParam() << " prompt " << p;
    EXPECT_EQ(got->logits, want->logits) << GetParam() << " prompt " << p;
  }
  for (int r = 0; r < 2; ++r) {
    const GraphStats& g = graphs->runner(r).graph_stats();
    EXPECT_GE(g.captures, 1) << "rank " << r;
    EXPECT_GE(g.replays, 1) << "rank " << r;
    EXPECT_TRUE(g.disabled.empty()) << "rank " << r << ": " << g.disabled;
    EXPECT_EQ(eager->runner(r).graph_stats().replays, 0) << "rank " << r;
    // The same collectives ran (batch 1: no padding), counted as they ran: the
    // graphs' at each replay. In stream order with one wait per step, eager
    // steps' too (no hooks here).
    const CommStats& c = graphs->runner(r).comm_stats();
    const CommStats& e = eager->runner(r).comm_stats();
    EXPECT_EQ(c.calls, e.calls) << "rank " << r;
    EXPECT_EQ(c.bytes, e.bytes) << "rank " << r;
    EXPECT_EQ(c.enqueued, c.calls) << "rank " << r;
  }
}

// The ranks agree on each step's graph plan: with a layer hook on rank 0 only
// (a prefill worker's layer streaming), a decode step of 3 sequences (bucket 4)
// runs eagerly on every rank (rank 1 padding it to 4 rows would all-reduce
// other sizes than rank 0); without the hook, every rank captures, then
// replays, together. The logits equal an enforce_eager group's throughout.
TEST_P(GpuTp, RanksAgreeOnEachStepsGraphPlan) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "TP 2 on " << GetParam() << " needs 2 GPUs, " << VisibleGpus()
                 << " visible";
  }
  TpExecutorOptions o = Options(2, GetParam());
  o.cache.num_slots = 4;
  TpExecutorOptions eager_options = o;
  eager_options.runner.enforce_eager = true;
  auto ex = Make(o);
  auto ref = Make(eager_options);
  ASSERT_TRUE(ex && ref);
  const int64_t V = ex->weights(0).config.text.vocab_size;
  std::vector<std::vector<int32_t>> prompts = {MakePrompt(6, 21), MakePrompt(9, 22),
                                               MakePrompt(4, 23)};
  std::vector<std::vector<int32_t>> tables = {BlockRange(0, 1), BlockRange(1, 2),
                                              BlockRange(2, 3)};
  std::vector<int64_t> pos(3, 0);
  std::vector<int32_t> next(3, 0);
  auto step = [&](bool prefill) -> absl::Status {
    std::vector<SequenceInput> in(3);
    std::vector<std::vector<int32_t>> toks(3);
    for (int i = 0; i < 3; ++i) {
      toks[i] = prefill ? prompts[i] : std::vector<int32_t>{next[i]};
      in[i].tokens = toks[i];
      in[i].start_pos = pos[i];
      in[i].block_table = tables[i];
      in[i].kda_slot = i;
      in[i].logits_indices = {static_cast<int32_t>(toks[i].size()) - 1};
    }
    std::vector<float> got, want;
    TANDEM_RETURN_IF_ERROR(ex->Forward(in, &got));
    TANDEM_RETURN_IF_ERROR(ref->Forward(in, &want));
    EXPECT_EQ(got, want);
    for (int i = 0; i < 3; ++i) {
      pos[i] += toks[i].size();
      next[i] = Argmax(absl::MakeConstSpan(got).subspan(i * V, V));
    }
    return absl::OkStatus();
  };
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(ex->ResetSlot(s).ok());
    ASSERT_TRUE(ref->ResetSlot(s).ok());
  }
  ASSERT_TRUE(step(/*prefill=*/true).ok());
  int layers = 0;
  ex->runner(0).set_layer_done_hook([&layers](int) { ++layers; });
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(step(false).ok());
  EXPECT_GT(layers, 0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ex->runner(r).graph_stats().captures, 0) << "rank " << r;
    EXPECT_EQ(ex->runner(r).graph_stats().replays, 0) << "rank " << r;
  }
  ex->runner(0).set_layer_done_hook(nullptr);
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(step(false).ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ex->runner(r).graph_stats().captures, 1) << "rank " << r;
    EXPECT_EQ(ex->runner(r).graph_stats().replays, 2) << "rank " << r;
    EXPECT_EQ(ex->runner(r).graph_stats().padded_rows, 3) << "rank " << r;
  }
}

// A rank whose device is too full for the largest bucket's buffers: the
// executor has every rank size a capture's buffers before the step
// (ModelRunner::PrepareGraph, no collectives), rank 1 fails there alone, and the
// step runs eagerly on both ranks, as every later one (rank 1's graphs are off).
// Without that phase rank 1 would fail inside the step, before its first
// collective, and rank 0 would wait in one until the timeout broke the group.
// The logits equal an enforce_eager group's. On cuda_sim, whose capacity is
// exact (a CUDA pool may hold freed memory that cudaMemGetInfo does not count).
TEST(GpuTpShortOfMemory, ARankShortOfGraphMemoryRunsTheStepEagerlyWithItsPeers) {
  if (!kernels::CreateBackend("cuda_sim").ok()) {
    GTEST_SKIP() << "cuda_sim is not in this build (--config=cuda)";
  }
  TpExecutorOptions o = Options(2, "cuda_sim");
  o.cache.num_slots = 4;
  TpExecutorOptions eager_options = o;
  eager_options.runner.enforce_eager = true;
  auto ex = Make(o);
  auto ref = Make(eager_options);
  ASSERT_TRUE(ex && ref);
  const int64_t V = ex->weights(0).config.text.vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {MakePrompt(6, 41),
                                                     MakePrompt(9, 42)};
  std::vector<int64_t> pos(2, 0);
  std::vector<int32_t> next(2, 0);
  auto step = [&](bool prefill) -> absl::Status {
    std::vector<SequenceInput> in(2);
    for (int i = 0; i < 2; ++i) {
      in[i].tokens =
          prefill ? absl::MakeConstSpan(prompts[i]) : absl::MakeConstSpan(&next[i], 1);
      in[i].start_pos = pos[i];
      in[i].block_table = BlockRange(4 * i, 4);
      in[i].kda_slot = i;
      in[i].logits_indices = {static_cast<int32_t>(in[i].tokens.size()) - 1};
    }
    std::vector<float> got, want;
    TANDEM_RETURN_IF_ERROR(ex->Forward(in, &got));
    TANDEM_RETURN_IF_ERROR(ref->Forward(in, &want));
    EXPECT_EQ(got, want);
    for (int i = 0; i < 2; ++i) {
      pos[i] += in[i].tokens.size();
      next[i] = Argmax(absl::MakeConstSpan(got).subspan(i * V, V));
    }
    return absl::OkStatus();
  };
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(ex->ResetSlot(s).ok());
    ASSERT_TRUE(ref->ResetSlot(s).ok());
  }
  ASSERT_TRUE(step(/*prefill=*/true).ok());
  // Rank 1's device full but 256 KiB: the prefill's buffers hold 2.5 rows of
  // logits, the largest bucket (4 sequences) needs 4.
  kernels::Device& dev1 = ex->backend(1).device();
  absl::StatusOr<kernels::DeviceBuffer> hog = kernels::DeviceBuffer::Allocate(
      &dev1, dev1.MemoryInfo().free_bytes - (256 << 10));
  ASSERT_TRUE(hog.ok()) << hog.status();
  const absl::Time t0 = absl::Now();
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(step(false).ok()) << k;
  EXPECT_LT(absl::Now() - t0, o.timeout) << "a rank waited out a collective";
  EXPECT_TRUE(ex->health().ok()) << ex->health();
  EXPECT_NE(ex->runner(1).graph_stats().disabled.find("did not fit"), std::string::npos)
      << ex->runner(1).graph_stats().disabled;
  EXPECT_TRUE(ex->runner(0).graph_stats().disabled.empty());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ex->runner(r).graph_stats().captures, 0) << "rank " << r;
    EXPECT_EQ(ex->runner(r).graph_stats().replays, 0) << "rank " << r;
    EXPECT_EQ(ex->runner(r).graph_stats().eager_steps, 4) << "rank " << r;
  }
}

// The TP 2 engine samples where rank 0's logits are (every rank holds the full
// logits after the all-gather; only rank 0's are sampled, and no rank copies
// its logits back): the same tokens as copying them back to the host sampler,
// greedy and seeded, every row on the device.
TEST_P(GpuTp, Tp2EngineSamplesOnRank0sDevice) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "TP 2 on " << GetParam() << " needs 2 GPUs, " << VisibleGpus()
                 << " visible";
  }
  auto run = [&](bool device_sampling, StepTimingStats* timing) {
    EngineOptions o;
    o.num_slots = 2;
    o.max_context_tokens = 64;
    o.max_tokens_per_step = 32;
    o.device_sampling = device_sampling;
    o.tp.tp_size = 2;
    o.tp.backend = GetParam();
    o.tp.threads_per_rank = 1;
    o.tp.timeout = absl::Seconds(20);
    o.tp_checkpoint = &Tiny();
    std::vector<std::vector<int32_t>> out(2);
    auto e = Engine::Create(nullptr, nullptr, nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return out;
    SamplingParams greedy, seeded;
    greedy.max_tokens = seeded.max_tokens = 4;
    greedy.ignore_eos = seeded.ignore_eos = true;
    seeded.temperature = 0.9f;
    seeded.top_k = 20;
    seeded.seed = 77;
    EXPECT_TRUE((*e)->AddRequest(0, Prompts()[0], greedy).ok());
    EXPECT_TRUE((*e)->AddRequest(1, Prompts()[1], seeded).ok());
    for (int step = 0; (*e)->HasWork() && step < 100; ++step) {
      auto res = (*e)->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) break;
      for (const RequestOutput& r : *res) {
        out[r.id].insert(out[r.id].end(), r.new_tokens.begin(), r.new_tokens.end());
      }
    }
    *timing = (*e)->step_timing();
    return out;
  };
  StepTimingStats on, off;
  const auto dev = run(true, &on);
  const auto host = run(false, &off);
  ASSERT_EQ(dev[0].size(), 4u);
  ASSERT_EQ(dev[1].size(), 4u);
  EXPECT_EQ(dev, host);
  EXPECT_EQ(on.device_sampled_rows, 8);
  EXPECT_EQ(on.host_sampled_rows, 0);
  EXPECT_EQ(off.device_sampled_rows, 0);
  EXPECT_EQ(off.host_sampled_rows, 8);
}

// The drill: one sequence through `ok_steps` forwards (two 4-token prefill
// chunks, then single tokens: the first one captured, the later ones replayed),
// then rank 1 stops at the next. That forward fails within the communicator
// timeout (plus the executor's slack) naming rank 1, and every later call fails
// at once. `check` looks at the group before the failing step.
void ExpectRankFailureAfter(const std::string& backend, int ok_steps,
                            const std::function<void(TpExecutor&)>& check = {}) {
  TpExecutorOptions o = Options(2, backend);
  o.timeout = absl::Seconds(5);
  o.fail_rank = 1;
  o.fail_rank_at_step = ok_steps;
  auto ex = Make(o);
  ASSERT_TRUE(ex);
  const std::vector<int32_t> blocks = BlockRange(0, 1);
  const std::vector<int32_t> toks = MakePrompt(8 + ok_steps, 9);
  std::vector<float> logits;
  int64_t pos = 0;
  auto step = [&](int k) {
    const int64_t count = k < 2 ? 4 : 1;
    SequenceInput in;
    in.tokens = absl::MakeConstSpan(toks).subspan(pos, count);
    in.start_pos = pos;
    in.block_table = blocks;
    in.logits_indices = {static_cast<int32_t>(count) - 1};
    absl::Status st = ex->Forward({&in, 1}, &logits);
    if (st.ok()) pos += count;
    return st;
  };
  for (int k = 0; k < ok_steps; ++k) ASSERT_TRUE(step(k).ok()) << "step " << k;
  if (check) check(*ex);
  const absl::Time t0 = absl::Now();
  absl::Status s = step(ok_steps);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("injected failure"), std::string::npos) << s;
  // Gloo fails the peer at once (closed connections); NCCL when rank 0's own
  // timeout passes.
  EXPECT_LT(took, o.timeout + absl::Seconds(10)) << absl::FormatDuration(took);
  ::testing::Test::RecordProperty(
      backend + "_drill" + std::to_string(ok_steps) + "_seconds",
      std::to_string(absl::ToDoubleSeconds(took)));
  EXPECT_FALSE(ex->health().ok());
  const absl::Time t1 = absl::Now();
  absl::Status later = step(ok_steps);
  EXPECT_TRUE(absl::IsUnavailable(later)) << later;
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later;
  EXPECT_LT(absl::Now() - t1, absl::Seconds(1));
}

// Rank 1 stops at its third forward, the first decode step (a capture).
TEST_P(GpuTp, RankFailureFailsTheStepAndBreaksTheExecutor) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "the TP 2 drill on " << GetParam() << " needs 2 GPUs, "
                 << VisibleGpus() << " visible";
  }
  ExpectRankFailureAfter(GetParam(), 2);
}

// Rank 1 stops during a graph replay: rank 0's replayed collectives fail as
// its eager ones do.
TEST_P(GpuTp, RankFailureDuringAGraphReplay) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "the TP 2 drill on " << GetParam() << " needs 2 GPUs, "
                 << VisibleGpus() << " visible";
  }
  ExpectRankFailureAfter(GetParam(), 4, [](TpExecutor& ex) {
    EXPECT_EQ(ex.runner(0).graph_stats().captures, 1);
    EXPECT_EQ(ex.runner(0).graph_stats().replays, 1);
  });
}

// The worker's drill (--tp_fail_rank_at_step 1:3) through the Engine on the
// device backend: forwards 0..2 succeed, forward 3 fails naming rank 1, and
// every later step fails fast (the worker stops taking work on that status).
TEST_P(GpuTp, EngineStepFailsCleanlyWhenARankStops) {
  if (MaxRanks(GetParam()) < 2) {
    GTEST_SKIP() << "the TP 2 drill on " << GetParam() << " needs 2 GPUs, "
                 << VisibleGpus() << " visible";
  }
  EngineOptions o;
  o.num_slots = 2;
  o.max_context_tokens = 64;
  o.max_tokens_per_step = 16;
  o.tp.tp_size = 2;
  o.tp.backend = GetParam();
  o.tp.threads_per_rank = 1;
  o.tp.timeout = absl::Seconds(5);
  o.tp.fail_rank = 1;
  o.tp.fail_rank_at_step = 3;
  o.tp_checkpoint = &Tiny();
  auto e = Engine::Create(nullptr, nullptr, nullptr, o);
  ASSERT_TRUE(e.ok()) << e.status();
  SamplingParams p;
  p.max_tokens = 20;
  p.ignore_eos = true;
  ASSERT_TRUE((*e)->AddRequest(1, MakePrompt(6, 1), p).ok());
  absl::Status failed;
  int steps = 0;
  const absl::Time t0 = absl::Now();
  for (; steps < 10 && failed.ok(); ++steps) failed = (*e)->Step().status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(60));
  EXPECT_EQ(steps, 4);  // forwards 0..2 succeed, forward 3 fails
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_NE(failed.message().find("rank 1"), std::string::npos) << failed;
  absl::Status later = (*e)->Step().status();
  EXPECT_TRUE(absl::IsUnavailable(later)) << later;
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later;
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuTp, ::testing::ValuesIn(GpuBackends()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GpuTp);

// A name with a GPU ordinal reaches the factory as kind + ordinal; bad ones are
// refused before any rank starts.
TEST(GpuTpOptions, BadBackendNamesAreRefused) {
  for (const char* bad : {"cuda:x", "cuda:-1", "cpu:1", "cuda_sim:"}) {
    auto ex = TpExecutor::Create(Tiny(), Options(2, bad));
    ASSERT_FALSE(ex.ok()) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(ex.status())) << bad << ": " << ex.status();
  }
  // A GPU ordinal past the visible GPUs names the rank and the ordinal.
  auto ex =
      TpExecutor::Create(Tiny(), Options(2, "cuda:" + std::to_string(VisibleGpus())));
  ASSERT_FALSE(ex.ok());
  EXPECT_NE(ex.status().message().find("rank 0"), std::string::npos) << ex.status();
}

}  // namespace
}  // namespace tandem::engine
