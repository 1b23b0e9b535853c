// Overlapped steps (EngineOptions::overlap_steps) on the GPU backends
// ("cuda_sim" everywhere; "cuda" where built with CUDA and a GPU is visible):
// while a decode step runs on the device thread the engine plans and launches
// the next one, its rows fed the tokens the running step samples, and emits
// the running step's tokens afterwards. Against the same engine with the
// overlap off:
//   - every request's tokens, logprobs and finish reason are identical (greedy,
//     seeded top-k / top-p with logprobs, min_tokens with the stop ids
//     suppressed, a stop token that ends one request early while the others go
//     on, a request arriving mid-decode);
//   - the overlap really ran (overlapped steps counted) and a request ended by
//     its token while the next step was in flight had that row thrown away;
//   - aborting a request whose step is in flight ends it and leaks nothing;
//     its state is not exported while a step of it runs (a clear error);
//   - a step that overruns overlap_step_timeout stops the engine with a clear
//     error instead of hanging or spinning.
#include <map>
#include <string>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeightsOn;

std::vector<std::string> GpuBackends() {
  std::vector<std::string> names;
  for (const char* n : {"cuda_sim", "cuda"}) {
    if (kernels::CreateBackend(n).ok()) names.push_back(n);
  }
  return names;
}

EngineOptions Options(bool overlap) {
  EngineOptions o;
  o.num_slots = 8;
  o.num_blocks = 96;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 512;
  o.overlap_steps = overlap;
  return o;
}

struct Outcome {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, std::vector<float>> logprobs;
  std::map<RequestId, FinishReason> finish;
  StepTimingStats timing;
  int32_t free_blocks_before = 0, free_blocks_after = 0;
  int32_t free_slots_before = 0, free_slots_after = 0;
};

class OverlapEngine : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    be_ = MakeBackend(GetParam().c_str());
    weights_ = TinyWeightsOn(*be_);
  }

  std::unique_ptr<Engine> Make(bool overlap) {
    auto e = Engine::Create(weights_.get(), be_.get(), nullptr, Options(overlap));
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  static void Collect(const std::vector<RequestOutput>& outs, Outcome* run) {
    for (const RequestOutput& o : outs) {
      auto& t = run->tokens[o.id];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      for (const SampleResult& lp : o.logprobs)
        run->logprobs[o.id].push_back(lp.logprob);
      if (o.finished) {
        EXPECT_FALSE(run->finish.contains(o.id))
            << "request " << o.id << " ended twice";
        run->finish[o.id] = o.finish_reason;
      }
    }
  }

  // Requests 0..params.size()-1; `late` (if any) is added after `late_after`
  // steps.
  Outcome Generate(bool overlap, const std::vector<SamplingParams>& params,
                   const SamplingParams* late = nullptr, int late_after = 0) {
    Outcome run;
    auto e = Make(overlap);
    if (e == nullptr) return run;
    run.free_blocks_before = e->num_free_blocks();
    run.free_slots_before = e->num_free_slots();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(e->AddRequest(i, MakePrompt(9 + 3 * i, 40 + i), params[i]).ok());
    }
    for (int step = 0; e->HasWork() && step < 400; ++step) {
      if (late != nullptr && step == late_after) {
        EXPECT_TRUE(e->AddRequest(100, MakePrompt(14, 90), *late).ok());
      }
      auto res = e->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) break;
      Collect(*res, &run);
    }
    EXPECT_FALSE(e->HasWork());
    run.timing = e->step_timing();
    run.free_blocks_after = e->num_free_blocks();
    run.free_slots_after = e->num_free_slots();
    return run;
  }

  std::unique_ptr<kernels::Backend> be_;
  std::unique_ptr<ModelWeights> weights_;
};

TEST_P(OverlapEngine, OverlappedStepsGiveTheSynchronousTokens) {
  std::vector<SamplingParams> params(5);
  for (SamplingParams& p : params) p.ignore_eos = true;
  params[0].max_tokens = 14;  // greedy
  params[1].max_tokens = 9;
  params[1].temperature = 0.8f;
  params[1].top_k = 30;
  params[1].seed = 5;
  params[2].max_tokens = 11;
  params[2].temperature = 1.0f;
  params[2].top_p = 0.9f;
  params[2].seed = 6;
  params[2].logprobs = true;
  params[2].top_logprobs = 3;
  params[3].max_tokens = 12;  // min_tokens: EOS suppressed for 4 tokens
  params[3].ignore_eos = false;
  params[3].min_tokens = 4;
  params[3].temperature = 1.2f;
  params[3].seed = 8;
  params[4].max_tokens = 16;  // ends early on a stop token (chosen below)
  SamplingParams late;
  late.max_tokens = 6;
  late.ignore_eos = true;

  // The stop token: request 4's 6th greedy token, from a run with it free.
  const Outcome unstopped = Generate(false, params);
  ASSERT_EQ(unstopped.tokens.at(4).size(), 16u);
  params[4].stop_token_ids = {unstopped.tokens.at(4)[5]};

  const Outcome sync = Generate(false, params, &late, 3);
  const Outcome over = Generate(true, params, &late, 3);
  ASSERT_EQ(sync.tokens.size(), 6u);
  EXPECT_LE(sync.tokens.at(4).size(), 6u);  // the stop token ended it
  EXPECT_EQ(sync.finish.at(4), FinishReason::kStop);
  EXPECT_EQ(over.tokens, sync.tokens);
  EXPECT_EQ(over.finish, sync.finish);
  ASSERT_EQ(over.logprobs.size(), 1u);
  EXPECT_EQ(over.logprobs, sync.logprobs);  // both sampled on the device
  for (const auto& [id, t] : sync.tokens) {
    const int64_t want = id == 100 ? late.max_tokens : params[id].max_tokens;
    if (id != 4 && id != 3) EXPECT_EQ(static_cast<int64_t>(t.size()), want) << id;
  }
  // The overlap ran, and request 4's row in the step after its stop token
  // was computed and thrown away. Off, nothing overlaps.
  EXPECT_GT(over.timing.overlapped_steps, 5);
  EXPECT_GE(over.timing.overlap_discarded_rows, 1);
  EXPECT_EQ(sync.timing.overlapped_steps, 0);
  EXPECT_EQ(sync.timing.overlap_discarded_rows, 0);
  // Every step of both ran a forward; the overlapped run's thrown-away rows
  // cost no extra steps beyond the ones in flight at each ending.
  EXPECT_EQ(over.timing.host_sampled_rows, 0);
  EXPECT_EQ(over.free_blocks_after, over.free_blocks_before);
  EXPECT_EQ(over.free_slots_after, over.free_slots_before);
  EXPECT_EQ(sync.free_blocks_after, sync.free_blocks_before);
}

TEST_P(OverlapEngine, AbortWhileInFlightEndsTheRequestAndLeaksNothing) {
  SamplingParams greedy;
  greedy.max_tokens = 20;
  greedy.ignore_eos = true;
  // The synchronous reference: requests 0 and 2 run to the end (batch
  // invariance: request 1's presence does not change their tokens).
  Outcome want;
  {
    auto e = Make(false);
    ASSERT_NE(e, nullptr);
    for (RequestId id : {0, 2}) {
      ASSERT_TRUE(e->AddRequest(id, MakePrompt(9 + 3 * id, 40 + id), greedy).ok());
    }
    for (int s = 0; e->HasWork() && s < 100; ++s) {
      auto res = e->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      Collect(*res, &want);
    }
  }
  auto e = Make(true);
  ASSERT_NE(e, nullptr);
  const int32_t blocks = e->num_free_blocks(), slots = e->num_free_slots();
  for (RequestId id : {0, 1, 2}) {
    ASSERT_TRUE(e->AddRequest(id, MakePrompt(9 + 3 * id, 40 + id), greedy).ok());
  }
  Outcome got;
  int s = 0;
  for (; e->HasWork() && s < 100 && e->step_timing().overlapped_steps < 4; ++s) {
    auto res = e->Step();
    ASSERT_TRUE(res.ok()) << res.status();
    Collect(*res, &got);
  }
  ASSERT_GE(e->step_timing().overlapped_steps, 4);
  // A step of request 1 is in flight now: its state cannot be taken, with a
  // clear error; aborting it works.
  auto state = e->ExportState(1);
  ASSERT_FALSE(state.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(state.status())) << state.status();
  EXPECT_NE(state.status().message().find("in flight"), std::string::npos);
  EXPECT_TRUE(absl::IsFailedPrecondition(e->Locate(1).status()));
  const size_t before_abort = got.tokens[1].size();
  ASSERT_TRUE(e->Abort(1).ok());
  EXPECT_TRUE(absl::IsNotFound(e->Abort(1)));
  for (; e->HasWork() && s < 200; ++s) {
    auto res = e->Step();
    ASSERT_TRUE(res.ok()) << res.status();
    Collect(*res, &got);
  }
  EXPECT_FALSE(e->HasWork());
  EXPECT_EQ(got.tokens[1].size(), before_abort);  // nothing after the abort
  EXPECT_FALSE(got.finish.contains(1));
  EXPECT_EQ(got.tokens.at(0), want.tokens.at(0));
  EXPECT_EQ(got.tokens.at(2), want.tokens.at(2));
  EXPECT_EQ(e->num_free_blocks(), blocks);
  EXPECT_EQ(e->num_free_slots(), slots);
}

// A step that overruns overlap_step_timeout stops the engine with a clear
// error (the step cannot be cut short): every later call gets it, HasWork() is
// false so a worker loop does not spin, health() reports it, and the engine
// still shuts down (its device thread finishes the step).
TEST_P(OverlapEngine, AnOverrunningStepStopsTheEngineWithAClearError) {
  EngineOptions o = Options(true);
  o.overlap_step_timeout = absl::Microseconds(1);
  auto e = Engine::Create(weights_.get(), be_.get(), nullptr, o);
  ASSERT_TRUE(e.ok()) << e.status();
  SamplingParams greedy;
  greedy.max_tokens = 8;
  greedy.ignore_eos = true;
  ASSERT_TRUE((*e)->AddRequest(1, MakePrompt(9, 40), greedy).ok());
  absl::Status failed;
  for (int s = 0; s < 20 && failed.ok(); ++s) failed = (*e)->Step().status();
  ASSERT_TRUE(absl::IsDeadlineExceeded(failed)) << failed;
  EXPECT_NE(failed.message().find("engine stopped"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("overlap_step_timeout"), std::string::npos) << failed;
  EXPECT_FALSE((*e)->HasWork());
  EXPECT_EQ((*e)->health(), failed);
  EXPECT_EQ((*e)->Step().status(), failed);
  EXPECT_EQ((*e)->AddRequest(2, MakePrompt(9, 41), greedy), failed);
  EXPECT_EQ((*e)->Quiesce(), failed);
  EXPECT_EQ(Engine::Create(weights_.get(), be_.get(), nullptr,
                           [] {
                             EngineOptions bad = Options(true);
                             bad.overlap_step_timeout = absl::ZeroDuration();
                             return bad;
                           }())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, OverlapEngine, ::testing::ValuesIn(GpuBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::engine
