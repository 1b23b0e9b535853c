#include "worker/prefix_event_log.h"

#include <algorithm>
#include <limits>

#include "absl/random/random.h"

namespace tandem::worker {

using tandem::v1::PrefixCacheEvent;

PrefixEventLog::PrefixEventLog(uint64_t epoch, int64_t max_pending, int max_per_report)
    : epoch_(epoch),
      max_pending_(std::max<int64_t>(max_pending, 1)),
      max_per_report_(std::max(max_per_report, 1)) {}

void PrefixEventLog::Add(const std::vector<engine::PrefixEvent>& events) {
  for (const engine::PrefixEvent& e : events) {
    PrefixCacheEvent p;
    auto& mirror = e.blocks_only ? held_blocks_ : held_;
    switch (e.kind) {
      case engine::PrefixEvent::Kind::kStored:
        p.set_kind(PrefixCacheEvent::KIND_STORED);
        mirror[e.route_hash] = e.tokens;
        break;
      case engine::PrefixEvent::Kind::kRemoved:
        p.set_kind(PrefixCacheEvent::KIND_REMOVED);
        mirror.erase(e.route_hash);
        break;
      case engine::PrefixEvent::Kind::kCleared:
        p.set_kind(PrefixCacheEvent::KIND_CLEARED);
        held_.clear();
        held_blocks_.clear();
        break;
    }
    if (p.kind() != PrefixCacheEvent::KIND_CLEARED) {
      p.set_tokens(e.tokens);
      p.set_route_hash(e.route_hash);
      p.set_blocks_only(e.blocks_only);
    }
    ++last_seq_;
    if (pending_.empty()) first_pending_ = last_seq_;
    pending_.push_back(std::move(p));
  }
  if (static_cast<int64_t>(pending_.size()) > max_pending_) {
    // The router has not acknowledged this much: a snapshot is cheaper than
    // the backlog (and bounded by what the cache holds).
    pending_.clear();
    needs_register_ = true;
  }
}

void PrefixEventLog::FillRegister(tandem::v1::RegisterRequest* r) {
  r->set_reports_prefix_cache(true);
  r->set_prefix_epoch(epoch_);
  r->set_prefix_seq(last_seq_);
  r->clear_prefix_snapshot();
  for (const auto& [hash, tokens] : held_) {
    PrefixCacheEvent* e = r->add_prefix_snapshot();
    e->set_kind(PrefixCacheEvent::KIND_STORED);
    e->set_tokens(tokens);
    e->set_route_hash(hash);
  }
  for (const auto& [hash, tokens] : held_blocks_) {
    PrefixCacheEvent* e = r->add_prefix_snapshot();
    e->set_kind(PrefixCacheEvent::KIND_STORED);
    e->set_tokens(tokens);
    e->set_route_hash(hash);
    e->set_blocks_only(true);
  }
  // Everything numbered so far is in the snapshot.
  pending_.clear();
  needs_register_ = false;
}

void PrefixEventLog::FillHeartbeat(tandem::v1::HeartbeatRequest* r) const {
  r->set_prefix_epoch(epoch_);
  r->set_prefix_first_seq(pending_.empty() ? last_seq_ + 1 : first_pending_);
  const size_t n = std::min<size_t>(pending_.size(), max_per_report_);
  for (size_t i = 0; i < n; ++i) *r->add_prefix_events() = pending_[i];
}

void PrefixEventLog::OnHeartbeatResponse(const tandem::v1::HeartbeatResponse& r) {
  if (r.resync_prefix_index()) {
    needs_register_ = true;
    return;
  }
  while (!pending_.empty() && first_pending_ <= r.prefix_acked_seq()) {
    pending_.pop_front();
    ++first_pending_;
  }
}

uint64_t RandomPrefixEpoch() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(absl::IntervalClosed, gen, 1,
                                 std::numeric_limits<uint64_t>::max());
}

}  // namespace tandem::worker
