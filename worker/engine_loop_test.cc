// EngineLoop on the tiny model: outputs reach the request's callback on the engine
// thread and match a direct Engine run; bad requests get their error; Cancel frees
// the blocks and runs its hook exactly once, only while the request is alive;
// the layer-progress callback reaches the engine.
#include "worker/engine_loop.h"

#include <vector>

#include "absl/synchronization/notification.h"
#include "engine/runtime/test_util.h"
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
