#include "worker/worker_load.h"

namespace tandem::worker {

tandem::v1::WorkerLoad LoadOf(const EngineLoopStats& s, int32_t kv_block_size) {
  tandem::v1::WorkerLoad load;
  load.set_queued_prefill_tokens(s.queued_prefill_tokens);
  load.set_running_requests(s.running);
  load.set_waiting_requests(s.waiting);
  load.set_free_kv_blocks(s.free_blocks);
  load.set_total_kv_blocks(s.total_blocks);
  load.set_free_state_slots(s.free_slots);
  load.set_total_state_slots(s.total_slots);
  load.set_kv_block_size(kv_block_size);
  return load;
}

}  // namespace tandem::worker
