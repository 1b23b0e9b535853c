#include "worker/worker_load.h"

#include <gtest/gtest.h>

namespace tandem::worker {
namespace {

TEST(WorkerLoadTest, EveryCountGoesToItsField) {
  EngineLoopStats s;
  s.free_blocks = 3;
  s.total_blocks = 40;
  s.free_slots = 5;
  s.total_slots = 6;
  s.running = 7;
  s.waiting = 8;
  s.queued_prefill_tokens = 900;
  const tandem::v1::WorkerLoad l = LoadOf(s, 16);
  EXPECT_EQ(l.free_kv_blocks(), 3);
  EXPECT_EQ(l.total_kv_blocks(), 40);
  EXPECT_EQ(l.free_state_slots(), 5);
  EXPECT_EQ(l.total_state_slots(), 6);
  EXPECT_EQ(l.running_requests(), 7);
  EXPECT_EQ(l.waiting_requests(), 8);
  EXPECT_EQ(l.queued_prefill_tokens(), 900);
  EXPECT_EQ(l.kv_block_size(), 16);
}

}  // namespace
}  // namespace tandem::worker
