// The load a worker reports to the router with every heartbeat: the engine
// thread's published counts (EngineLoop::stats()), in the registry's message.
// Both worker roles report the engine's own numbers: a decode worker's reserved
// and quarantined memory is held by the engine, so it is not free there either.
#ifndef TANDEM_WORKER_WORKER_LOAD_H_
#define TANDEM_WORKER_WORKER_LOAD_H_

#include <cstdint>

#include "proto/worker.pb.h"
#include "worker/engine_loop.h"

namespace tandem::worker {

tandem::v1::WorkerLoad LoadOf(const EngineLoopStats& stats, int32_t kv_block_size);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_LOAD_H_
