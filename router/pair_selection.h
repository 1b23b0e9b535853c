// Which prefill and which decode worker take a request. Pure functions over the
// registry's records (load from heartbeats) plus the router's own count of
// requests it has in flight on each worker since (heartbeats lag).
//
//   prefill: least (queued prefill tokens + tokens the router sent since), then
//            fewest running, then id (stable)
//   decode:  must have a free state slot and room for the prompt; most free KV
//            tokens (free blocks * block size, minus what the router placed
//            since) plus the prompt tokens whose MLA rows it already holds
//            (`held`: a decode-side prefix hit, which the wire does not carry),
//            then fewest running (+ in flight), then id. One held token weighs
//            as one free token: the holder wins when it has about as much
//            room, and a worker with far more room still wins, so a prefix
//            every request shares (a system prompt) does not pull every
//            request onto one worker.
#ifndef TANDEM_ROUTER_PAIR_SELECTION_H_
#define TANDEM_ROUTER_PAIR_SELECTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "router/worker_registry.h"

namespace tandem::router {

// What the router itself has placed on a worker and not seen finish.
struct InFlight {
  int32_t requests = 0;
  int64_t tokens = 0;  // prompt tokens (prefill) or reserved tokens (decode)
};
using InFlightMap = absl::flat_hash_map<std::string, InFlight>;

// Index into `workers` of the prefill worker to use, skipping `exclude`.
std::optional<size_t> SelectPrefill(const std::vector<WorkerRecord>& workers,
                                    const absl::flat_hash_set<std::string>& exclude,
                                    const InFlightMap& in_flight);

// Index into `workers` of the decode worker to use for a prompt of
// `prompt_tokens`, skipping `exclude` and workers that cannot hold it.
// `held` (may be null): tokens of the prompt each worker holds
// (PrefillRouter::HeldBlocks).
std::optional<size_t> SelectDecode(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens,
    const absl::flat_hash_map<std::string, int64_t>* held = nullptr);

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_PAIR_SELECTION_H_
