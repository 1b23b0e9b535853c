#include "router/pair_selection.h"

#include <tuple>

namespace tandem::router {
namespace {

InFlight Get(const InFlightMap& m, const std::string& id) {
  auto it = m.find(id);
  return it == m.end() ? InFlight{} : it->second;
}

}  // namespace

std::optional<size_t> SelectPrefill(const std::vector<WorkerRecord>& workers,
                                    const absl::flat_hash_set<std::string>& exclude,
                                    const InFlightMap& in_flight) {
  std::optional<size_t> best;
  std::tuple<int64_t, int64_t, std::string> best_key;
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string& id = workers[i].registration.worker_id();
    if (exclude.contains(id)) continue;
    const InFlight f = Get(in_flight, id);
    const tandem::v1::WorkerLoad& l = workers[i].load;
    auto key =
        std::make_tuple(l.queued_prefill_tokens() + f.tokens,
                        static_cast<int64_t>(l.running_requests()) + f.requests, id);
    if (!best.has_value() || key < best_key) {
      best = i;
      best_key = std::move(key);
    }
  }
  return best;
}

std::optional<size_t> SelectDecode(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, const absl::flat_hash_map<std::string, int64_t>* held) {
  std::optional<size_t> best;
  std::tuple<int64_t, int64_t, std::string> best_key;
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string& id = workers[i].registration.worker_id();
    if (exclude.contains(id)) continue;
    const tandem::v1::WorkerLoad& l = workers[i].load;
    const InFlight f = Get(in_flight, id);
    const int64_t block = l.kv_block_size() > 0 ? l.kv_block_size() : 1;
    const int64_t free_tokens = l.free_kv_blocks() * block - f.tokens;
    if (l.total_state_slots() > 0 && l.free_state_slots() - f.requests <= 0) continue;
    if (l.total_kv_blocks() > 0 && free_tokens < prompt_tokens + 1) continue;
    int64_t holds = 0;
    if (held != nullptr) {
      if (auto h = held->find(id); h != held->end()) {
        holds = std::min<int64_t>(h->second, prompt_tokens);
      }
    }
    auto key =
        std::make_tuple(-(free_tokens + holds),
                        static_cast<int64_t>(l.running_requests()) + f.requests, id);
    if (!best.has_value() || key < best_key) {
      best = i;
      best_key = std::move(key);
    }
  }
  return best;
}

}  // namespace tandem::router
