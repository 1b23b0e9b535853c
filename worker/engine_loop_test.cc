// EngineLoop on the tiny model: outputs reach the request's callback on the engine
// thread and match a direct Engine run; bad requests get their error; Cancel frees
// the blocks and runs its hook exactly once, only while the request is alive;
// the layer-progress callback reaches the engine.
#include "worker/engine_loop.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "engine/runtime/test_util.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

struct Rig {
  std::unique_ptr<kernels::Backend> backend = engine::testing::MakeBackend("cpu");
  std::unique_ptr<engine::Engine> Make() {
    engine::EngineOptions o;
    o.num_slots = 2;
    o.max_context_tokens = 256;
    return *engine::Engine::Create(&engine::testing::TinyWeights(), backend.get(),
                                   nullptr, o);
  }
};

engine::SamplingParams Greedy(int n) {
  engine::SamplingParams p;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

TEST(EngineLoopTest, StreamsOutputsLikeADirectRun) {
  Rig rig;
  const std::vector<int32_t> prompt = engine::testing::MakePrompt(21, 3);
  auto direct = rig.Make();
  ASSERT_TRUE(direct->AddRequest(1, prompt, Greedy(6)).ok());
  std::vector<int32_t> want;
  while (direct->HasWork()) {
    auto step = direct->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& o : *step) {
      want.insert(want.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  EngineLoop loop(rig.Make());
  std::vector<int32_t> got;  // written on the engine thread only
  absl::Notification done;
  loop.AddRequest(9, prompt, Greedy(6),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    ASSERT_TRUE(o.ok());
                    got.insert(got.end(), o->new_tokens.begin(), o->new_tokens.end());
                    if (o->finished) done.Notify();
                  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(got, want);
}

TEST(EngineLoopTest, BadRequestGetsItsError) {
  Rig rig;
  EngineLoop loop(rig.Make());
  absl::Notification done;
  absl::Status status;
  loop.AddRequest(1, {}, Greedy(3),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    status = o.status();
                    done.Notify();
                  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

// AddRequestOnLoopThread adds inside the calling command: a CancelOnLoopThread
// posted behind that command (while it ran) finds the request alive and aborts
// it, where AddRequest's queued add would come after the cancel and run on.
TEST(EngineLoopTest, AnAddOnTheLoopThreadIsSeenByACancelQueuedBehindIt) {
  Rig rig;
  EngineLoop loop(rig.Make());
  absl::Notification in_command, cancel_posted, checked;
  std::atomic<int> outputs{0};
  bool alive = false;
  const auto count = [&](engine::Engine&,
                         const absl::StatusOr<engine::RequestOutput>&) {
    outputs.fetch_add(1);
  };
  loop.Post([&](engine::Engine& e) {
    in_command.Notify();
    cancel_posted.WaitForNotification();  // the cancel is queued behind us
    loop.AddRequestOnLoopThread(e, 5, engine::testing::MakePrompt(9, 1), Greedy(20),
                                count);
  });
  ASSERT_TRUE(in_command.WaitForNotificationWithTimeout(absl::Seconds(10)));
  loop.Post([&](engine::Engine& e) {
    alive = loop.CancelOnLoopThread(e, 5);
    checked.Notify();
  });
  cancel_posted.Notify();
  ASSERT_TRUE(checked.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(alive);
  const int before = outputs.load();  // a step may have run between the commands
  absl::Notification idle;
  loop.Post([&](engine::Engine& e) {
    EXPECT_FALSE(e.HasWork());  // aborted: nothing left to step
    idle.Notify();
  });
  ASSERT_TRUE(idle.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outputs.load(), before);  // its callback was dropped
  EXPECT_LE(before, 1);               // 20 tokens asked: cut short
}

TEST(EngineLoopTest, CancelFreesBlocksAndRunsItsHookOnce) {
  Rig rig;
  EngineLoop loop(rig.Make());
  absl::Notification first;
  int outputs = 0;
  loop.AddRequest(4, engine::testing::MakePrompt(40, 1), Greedy(200),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    if (++outputs == 1) first.Notify();
                  });
  ASSERT_TRUE(first.WaitForNotificationWithTimeout(absl::Seconds(30)));
  int hooks = 0;
  absl::Notification cancelled, second;
  loop.Cancel(4, [&] {
    ++hooks;
    cancelled.Notify();
  });
  ASSERT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // A second cancel of the ended request does nothing; a later command proves it ran.
  loop.Cancel(4, [&] { ++hooks; });
  loop.Post([&](engine::Engine& e) {
    EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
    EXPECT_FALSE(e.HasWork());
    second.Notify();
  });
  ASSERT_TRUE(second.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(hooks, 1);
  EXPECT_LT(outputs, 200);
}

// Abort drops a live request's callback (never called again) and frees a
// reservation's blocks and slot (the decode worker's lease expiry, release and
// quarantine end); stats() shows reserved memory as used until then.
TEST(EngineLoopTest, AbortEndsARequestAndFreesAReservation) {
  Rig rig;
  EngineLoop loop(rig.Make());
  absl::Notification first, reserved, checked;
  int outputs = 0;
  loop.AddRequest(5, engine::testing::MakePrompt(30, 2), Greedy(200),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    if (++outputs == 1) first.Notify();
                  });
  ASSERT_TRUE(first.WaitForNotificationWithTimeout(absl::Seconds(30)));
  int32_t total = 0;
  loop.Post([&](engine::Engine& e) {
    total = e.scheduler().config().num_blocks;
    EXPECT_TRUE(e.Reserve(6, 40).ok());
    reserved.Notify();
  });
  ASSERT_TRUE(reserved.WaitForNotificationWithTimeout(absl::Seconds(10)));
  loop.Abort(5);
  loop.Post([&](engine::Engine& e) { checked.Notify(); });
  ASSERT_TRUE(checked.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // A command posted now runs in a later batch: the one above was published.
  absl::Notification published;
  loop.Post([&](engine::Engine& e) { published.Notify(); });
  ASSERT_TRUE(published.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const int outputs_at_abort = outputs;
  EngineLoopStats s = loop.stats();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.free_blocks, total - 3);  // 40 positions in blocks of 16: held
  EXPECT_EQ(s.free_slots, s.total_slots - 1);
  loop.Abort(6);
  absl::Notification freed;
  loop.Post([&](engine::Engine& e) {
    EXPECT_EQ(e.num_free_blocks(), total);
    EXPECT_EQ(e.scheduler().num_reserved(), 0);
    freed.Notify();
  });
  ASSERT_TRUE(freed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outputs, outputs_at_abort);
  EXPECT_LT(outputs, 200);
}

// The layer-progress callback installed through the loop sees each layer of a
// prefill once, in order, on the engine thread; CancelOnLoopThread aborts a live
// request once (true), then reports it gone (false).
TEST(EngineLoopTest, LayerProgressAndCancelOnLoopThread) {
  Rig rig;
  EngineLoop loop(rig.Make());
  std::vector<int> layers;
  std::vector<engine::LayerProgressEntry> seen;
  loop.SetLayerProgressCallback(
      [&](int layer, absl::Span<const engine::LayerProgressEntry> entries) {
        layers.push_back(layer);
        for (engine::LayerProgressEntry e : entries) {
          e.block_table = {};  // valid during the callback only
          seen.push_back(e);
        }
      });
  absl::Notification first;
  loop.AddRequest(9, engine::testing::MakePrompt(40, 2), Greedy(50),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    if (o.ok() && !o->new_tokens.empty() && !first.HasBeenNotified()) {
                      first.Notify();
                    }
                  });
  ASSERT_TRUE(first.WaitForNotificationWithTimeout(absl::Seconds(30)));
  absl::Notification done;
  bool alive = false, again = true;
  loop.Post([&](engine::Engine& e) {
    alive = loop.CancelOnLoopThread(e, 9);
    again = loop.CancelOnLoopThread(e, 9);
    EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(alive);
  EXPECT_FALSE(again);
  const int num_layers = static_cast<int>(engine::testing::TinyWeights().layers.size());
  ASSERT_EQ(static_cast<int>(layers.size()), num_layers);  // one chunk, no decodes
  for (int l = 0; l < num_layers; ++l) {
    EXPECT_EQ(layers[l], l);
    EXPECT_EQ(seen[l].id, 9);
    EXPECT_EQ(seen[l].start_pos, 0);
    EXPECT_EQ(seen[l].end_pos, 40);
    EXPECT_TRUE(seen[l].completes_prefill);
  }
}

}  // namespace
}  // namespace tandem::worker

namespace tandem::worker {
namespace {

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* t = [] {
    auto r = tokenizer::Tokenizer::Load(engine::testing::kTinyCheckpointDir);
    EXPECT_TRUE(r.ok()) << r.status();
    return std::move(*r).release();
  }();
  return *t;
}

struct TokRig {
  std::unique_ptr<kernels::Backend> backend = engine::testing::MakeBackend("cpu");
  std::unique_ptr<engine::Engine> Make() {
    engine::EngineOptions o;
    o.num_slots = 4;
    o.max_context_tokens = 256;
    return *engine::Engine::Create(&engine::testing::TinyWeights(), backend.get(),
                                   &Tok(), o);
  }
};

engine::SamplingParams Constrained(int n, const char* schema) {
  engine::SamplingParams p;
  p.max_tokens = n;
  engine::StructuredOutputSpec s;
  s.kind = engine::StructuredOutputSpec::Kind::kJsonSchema;
  s.source = schema;
  p.structured = s;
  return p;
}

constexpr char kSchema[] =
    R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},)"
    R"("required":["a","b"]})";

// Tokens of one request through the loop, and the engine's compile counters
// read on the engine thread after it ended.
struct LoopRun {
  absl::Status status;
  std::vector<int32_t> tokens;
  int64_t precompiled = -1;
  int64_t at_admission = -1;
};

LoopRun RunOnLoop(EngineLoop& loop, engine::RequestId id, std::vector<int32_t> prompt,
                  engine::SamplingParams p) {
  LoopRun run;
  absl::Notification done, counted;
  loop.AddRequest(id, std::move(prompt), std::move(p),
                  [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>& o) {
                    if (!o.ok()) {
                      run.status = o.status();
                      done.Notify();
                      return;
                    }
                    run.tokens.insert(run.tokens.end(), o->new_tokens.begin(),
                                      o->new_tokens.end());
                    if (o->finished) done.Notify();
                  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  loop.Post([&](engine::Engine& e) {
    run.precompiled = e.structured_precompiled();
    run.at_admission = e.structured_compiled_at_admission();
    counted.Notify();
  });
  EXPECT_TRUE(counted.WaitForNotificationWithTimeout(absl::Seconds(10)));
  return run;
}

// A constrained request's grammar is compiled on the loop's compile thread,
// not at admission on the engine thread, and the tokens are those of a direct
// run (which compiles at admission).
TEST(EngineLoopCompileTest, AConstrainedRequestIsCompiledOffTheEngineThread) {
  TokRig rig;
  const std::vector<int32_t> prompt = engine::testing::MakePrompt(12, 5);
  auto direct = rig.Make();
  ASSERT_TRUE(direct->AddRequest(1, prompt, Constrained(24, kSchema)).ok());
  std::vector<int32_t> want;
  while (direct->HasWork()) {
    auto step = direct->Step();
    ASSERT_TRUE(step.ok()) << step.status();
    for (const auto& o : *step) {
      want.insert(want.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  EXPECT_EQ(direct->structured_compiled_at_admission(), 1);
  EXPECT_EQ(direct->structured_precompiled(), 0);
  ASSERT_FALSE(want.empty());

  EngineLoop loop(rig.Make());
  LoopRun run = RunOnLoop(loop, 7, prompt, Constrained(24, kSchema));
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_EQ(run.tokens, want);
  EXPECT_EQ(run.precompiled, 1);
  EXPECT_EQ(run.at_admission, 0);
}

TEST(EngineLoopCompileTest, ACompileErrorReachesTheCallback) {
  TokRig rig;
  EngineLoop loop(rig.Make());
  LoopRun run = RunOnLoop(loop, 3, engine::testing::MakePrompt(8, 1),
                          Constrained(8, R"({"type":"object","not":{}})"));
  EXPECT_EQ(run.status.code(), absl::StatusCode::kInvalidArgument) << run.status;
  EXPECT_TRUE(run.tokens.empty());
  EXPECT_EQ(run.precompiled, 0);
  EXPECT_EQ(run.at_admission, 0);
}

// Abort and Cancel reach a request whose grammar is still queued for the
// compile thread (held here behind a CompileAhead whose callback blocks): it
// is never added, its callback never runs, Cancel's hook runs once.
TEST(EngineLoopCompileTest, AbortAndCancelReachARequestStillCompiling) {
  TokRig rig;
  EngineLoop loop(rig.Make());
  absl::Notification in_first, release;
  loop.CompileAhead(Constrained(4, kSchema),
                    [&](absl::StatusOr<engine::SamplingParams> p) {
                      EXPECT_TRUE(p.ok()) << p.status();
                      EXPECT_NE(p->structured->compiled, nullptr);
                      in_first.Notify();
                      release.WaitForNotification();
                    });
  ASSERT_TRUE(in_first.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::atomic<int> outputs{0};
  auto count = [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>&) {
    ++outputs;
  };
  loop.AddRequest(10, engine::testing::MakePrompt(8, 2), Constrained(8, kSchema),
                  count);
  loop.AddRequest(11, engine::testing::MakePrompt(8, 3), Constrained(8, kSchema),
                  count);
  loop.Abort(10);
  std::atomic<int> hooks{0};
  absl::Notification hooked;
  loop.Cancel(11, [&] {
    ++hooks;
    hooked.Notify();
  });
  ASSERT_TRUE(hooked.WaitForNotificationWithTimeout(absl::Seconds(10)));
  release.Notify();
  // A third request queued behind them runs: the two were dropped, not stuck.
  LoopRun run =
      RunOnLoop(loop, 12, engine::testing::MakePrompt(8, 4), Constrained(6, kSchema));
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_FALSE(run.tokens.empty());
  absl::Notification checked;
  loop.Post([&](engine::Engine& e) {
    EXPECT_FALSE(e.HasWork());
    EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
    checked.Notify();
  });
  ASSERT_TRUE(checked.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(outputs.load(), 0);
  EXPECT_EQ(hooks.load(), 1);
  EXPECT_EQ(run.precompiled, 1);  // only request 12 was added
}

// While idle, the compile thread fills a compiled grammar's mask cache ahead
// of use (kMaskPrecomputeBudget per grammar); a request with the same schema
// then uses the same compiled grammar (the compiler's cache) with every state
// warm: its masks compute no new entry.
TEST(EngineLoopCompileTest, TheCompileThreadPrecomputesMasksWhileIdle) {
  TokRig rig;
  EngineLoop loop(rig.Make());
  std::shared_ptr<const grammar::CompiledGrammar> g;
  absl::Notification compiled;
  loop.CompileAhead(Constrained(4, kSchema),
                    [&](absl::StatusOr<engine::SamplingParams> p) {
                      ASSERT_TRUE(p.ok()) << p.status();
                      g = p->structured->compiled;
                      compiled.Notify();
                    });
  ASSERT_TRUE(compiled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_NE(g, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!g->mask_cache().precomputed() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(g->mask_cache().precomputed());
  const int64_t entries = g->mask_cache().computed_entries();
  EXPECT_GT(entries, 0);
  LoopRun run =
      RunOnLoop(loop, 20, engine::testing::MakePrompt(10, 6), Constrained(24, kSchema));
  ASSERT_TRUE(run.status.ok()) << run.status;
  EXPECT_FALSE(run.tokens.empty());
  EXPECT_EQ(g->mask_cache().computed_entries(), entries);
}

// A CancelOnLoopThread command posted while the request compiles but run after
// the compile finished (its add queued right behind the cancel) still cancels
// it: the request is never added. A second Cancel, or a Cancel after an Abort,
// of a request still compiling finds it ended and does not run its hook.
TEST(EngineLoopCompileTest, ACancelQueuedDuringTheCompileWinsOverItsAdd) {
  TokRig rig;
  EngineLoop loop(rig.Make());
  absl::Notification in_first, release;
  loop.CompileAhead(Constrained(4, kSchema),
                    [&](absl::StatusOr<engine::SamplingParams>) {
                      in_first.Notify();
                      release.WaitForNotification();
                    });
  ASSERT_TRUE(in_first.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The engine thread waits inside a command until the compiles are done.
  absl::Notification engine_held, engine_release;
  loop.Post([&](engine::Engine&) {
    engine_held.Notify();
    engine_release.WaitForNotification();
  });
  ASSERT_TRUE(engine_held.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::atomic<int> outputs{0};
  auto count = [&](engine::Engine&, const absl::StatusOr<engine::RequestOutput>&) {
    ++outputs;
  };
  loop.AddRequest(20, engine::testing::MakePrompt(8, 2), Constrained(8, kSchema),
                  count);
  bool cancelled = false;
  loop.Post([&](engine::Engine& e) { cancelled = loop.CancelOnLoopThread(e, 20); });
  loop.AddRequest(21, engine::testing::MakePrompt(8, 3), Constrained(8, kSchema),
                  count);
  loop.AddRequest(22, engine::testing::MakePrompt(8, 5), Constrained(8, kSchema),
                  count);
  std::atomic<int> hooks{0};
  loop.Cancel(21, [&] { ++hooks; });
  loop.Cancel(21, [&] { ++hooks; });  // already cancelled: not alive
  loop.Abort(22);
  loop.Cancel(22, [&] { ++hooks; });  // aborted: not alive
  // Compiles run in order: once this one's callback runs, 20-22 are compiled
  // and their continuations have run (the adds queued behind the cancel).
  absl::Notification compiled;
  loop.CompileAhead(Constrained(4, kSchema),
                    [&](absl::StatusOr<engine::SamplingParams>) { compiled.Notify(); });
  release.Notify();
  ASSERT_TRUE(compiled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  engine_release.Notify();
  LoopRun run =
      RunOnLoop(loop, 23, engine::testing::MakePrompt(8, 4), Constrained(6, kSchema));
  ASSERT_TRUE(run.status.ok()) << run.status;
  absl::Notification checked;
  loop.Post([&](engine::Engine& e) {
    EXPECT_FALSE(e.HasWork());
    EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
    checked.Notify();
  });
  ASSERT_TRUE(checked.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(cancelled);
  EXPECT_EQ(outputs.load(), 0);
  EXPECT_EQ(hooks.load(), 1);
  EXPECT_EQ(run.precompiled, 1);  // only request 23 was added
}

}  // namespace
}  // namespace tandem::worker
