// The workers' ResetPrefixCache RPC (PrefillWorker and DecodeWorker share it):
// engine::Engine::ResetPrefixCache runs on the engine thread, between steps,
// as a command of the worker's EngineLoop; the RPC ends when it has run.
// Running requests keep their blocks and snapshots (the engine's contract);
// only what the cache holds for future hits is dropped. A command the loop
// drops because it is stopping ends the RPC UNAVAILABLE, so the call always
// ends (the caller's deadline bounds a long step it waits behind).
#ifndef TANDEM_WORKER_PREFIX_CACHE_RESET_H_
#define TANDEM_WORKER_PREFIX_CACHE_RESET_H_

#include <grpcpp/grpcpp.h>

#include "worker/engine_loop.h"

namespace tandem::worker {

// Posts the reset to `loop` (not owned; must outlive the command) and returns
// the call's reactor, finished once the engine thread ran it.
grpc::ServerUnaryReactor* ResetPrefixCacheOnLoop(grpc::CallbackServerContext* context,
                                                 EngineLoop* loop);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_PREFIX_CACHE_RESET_H_
