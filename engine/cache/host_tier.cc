#include "engine/cache/host_tier.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"

namespace tandem::engine {

absl::StatusOr<int64_t> ResolveHostTierBudget(absl::string_view spec,
                                              int64_t kv_cache_budget_bytes,
                                              int64_t mem_available_bytes) {
  const absl::string_view text = absl::StripAsciiWhitespace(spec);
  if (text.empty()) {
    if (mem_available_bytes <= 0) {
      return InvalidArgument(
          "--prefix_host_memory: the host memory available cannot be read for the "
          "default (min(2 x --kv_cache_memory, half of it)); give bytes, like 16GiB, "
          "or 0 for off");
    }
    return std::min(2 * std::max<int64_t>(0, kv_cache_budget_bytes),
                    mem_available_bytes / 2);
  }
  if (text == "0") return 0;
  absl::StatusOr<MemoryBudget> b = ParseMemoryBudget(text);
  if (!b.ok()) return InvalidArgument("--prefix_host_memory: ", b.status().message());
  if (b->is_fraction()) {
    return InvalidArgument(
        "--prefix_host_memory=", text,
        " is a fraction; give bytes with a unit, like 16GiB (0: off)");
  }
  return b->bytes;
}

HostTier::HostTier(int64_t budget_bytes)
    : budget_(std::max<int64_t>(0, budget_bytes)) {}

bool HostTier::IsLeaf(Hash h) const {
  auto it = children_.find(h);
  return it == children_.end() || it->second.empty();
}

bool HostTier::MakeRoom(int64_t extra, std::vector<PrefixEvent>* removed) {
  if (extra > budget_) return false;
  if (held_ + extra <= budget_) return true;
  // Check first that enough can go, so that a put that cannot fit evicts
  // nothing: pinned entries, the blocks of pinned snapshots and their
  // ancestors here stay; everything else can go leaves first (evicting a leaf
  // makes its parent a leaf, which a later pass of the loop below picks up).
  absl::flat_hash_set<Hash> kept;
  auto keep_chain = [&](Hash h) {
    for (auto it = blocks_.find(h); it != blocks_.end() && kept.insert(h).second;
         it = blocks_.find(h)) {
      if (!it->second.has_parent) break;
      h = it->second.parent;
    }
  };
  for (Hash h : pinned_blocks_) keep_chain(h);
  for (Hash h : pinned_snapshots_) keep_chain(h);
  int64_t stays = 0;
  for (Hash h : kept) stays += static_cast<int64_t>(blocks_.at(h).bytes.size());
  for (Hash h : pinned_snapshots_) {
    if (auto it = snapshots_.find(h); it != snapshots_.end()) {
      stays += static_cast<int64_t>(it->second.info.bytes.size());
    }
  }
  if (stays + extra > budget_) return false;
  while (held_ + extra > budget_) {
    bool evicted = false;
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      const auto [use, kind, h] = *it;
      if (kind == kSnapshotKind) {
        if (pinned_snapshots_.contains(h)) continue;
        DropSnapshot(h, removed);
        ++stats_.snapshots_evicted;
      } else {
        if (pinned_blocks_.contains(h) || !IsLeaf(h)) continue;
        if (snapshots_.contains(h) && pinned_snapshots_.contains(h)) continue;
        if (snapshots_.contains(h)) {
          DropSnapshot(h, removed);
          ++stats_.snapshots_evicted;
        }
        RemoveBlock(h);
        ++stats_.blocks_evicted;
      }
      evicted = true;
      break;
    }
    if (!evicted) return false;
  }
  return true;
}

bool HostTier::PutBlock(Hash h, Hash parent, bool has_parent,
                        std::vector<uint8_t> bytes, std::vector<PrefixEvent>* removed) {
  const int64_t n = static_cast<int64_t>(bytes.size());
  if (blocks_.contains(h)) return false;
  // The parent must not go to make room for its child: pin it meanwhile.
  const bool pin_parent = has_parent && !pinned_blocks_.contains(parent);
  if (pin_parent) pinned_blocks_.insert(parent);
  const bool room = MakeRoom(n, removed);
  if (pin_parent) pinned_blocks_.erase(parent);
  if (!room) {
    ++stats_.puts_refused;
    return false;
  }
  Block b;
  b.parent = parent;
  b.has_parent = has_parent;
  b.last_use = ++clock_;
  b.bytes = std::move(bytes);
  lru_.emplace(b.last_use, kBlockKind, h);
  if (has_parent) children_[parent].insert(h);
  blocks_.emplace(h, std::move(b));
  held_ += n;
  ++stats_.blocks_stored;
  return true;
}

bool HostTier::PutSnapshot(Hash key, int64_t tokens, uint64_t route_hash,
                           std::vector<uint8_t> bytes,
                           std::vector<PrefixEvent>* removed) {
  const int64_t n = static_cast<int64_t>(bytes.size());
  if (snapshots_.contains(key)) return false;
  const bool pin_block = !pinned_blocks_.contains(key);
  if (pin_block) pinned_blocks_.insert(key);  // its block stays while it fits
  const bool room = MakeRoom(n, removed);
  if (pin_block) pinned_blocks_.erase(key);
  if (!room) {
    ++stats_.puts_refused;
    return false;
  }
  Snap s;
  s.last_use = ++clock_;
  s.info.tokens = tokens;
  s.info.route_hash = route_hash;
  s.info.bytes = std::move(bytes);
  lru_.emplace(s.last_use, kSnapshotKind, key);
  snapshots_.emplace(key, std::move(s));
  held_ += n;
  ++stats_.snapshots_stored;
  return true;
}

void HostTier::RemoveBlock(Hash h) {
  auto it = blocks_.find(h);
  if (it == blocks_.end()) return;
  lru_.erase({it->second.last_use, kBlockKind, h});
  if (it->second.has_parent) {
    auto c = children_.find(it->second.parent);
    if (c != children_.end()) {
      c->second.erase(h);
      if (c->second.empty()) children_.erase(c);
    }
  }
  held_ -= static_cast<int64_t>(it->second.bytes.size());
  blocks_.erase(it);
}

std::optional<std::vector<uint8_t>> HostTier::TakeBlock(Hash h) {
  auto it = blocks_.find(h);
  if (it == blocks_.end()) return std::nullopt;
  std::vector<uint8_t> bytes = std::move(it->second.bytes);
  it->second.bytes.clear();
  held_ -= static_cast<int64_t>(bytes.size());
  it->second.bytes.shrink_to_fit();
  RemoveBlock(h);  // held_ already lowered: its bytes are empty now
  ++stats_.blocks_taken;
  return bytes;
}

std::optional<HostTier::SnapshotInfo> HostTier::TakeSnapshot(Hash key) {
  auto it = snapshots_.find(key);
  if (it == snapshots_.end()) return std::nullopt;
  SnapshotInfo info = std::move(it->second.info);
  held_ -= static_cast<int64_t>(info.bytes.size());
  lru_.erase({it->second.last_use, kSnapshotKind, key});
  snapshots_.erase(it);
  ++stats_.snapshots_taken;
  return info;
}

const HostTier::SnapshotInfo* HostTier::PeekSnapshot(Hash key) const {
  auto it = snapshots_.find(key);
  return it == snapshots_.end() ? nullptr : &it->second.info;
}

void HostTier::DropSnapshot(Hash key, std::vector<PrefixEvent>* removed) {
  auto it = snapshots_.find(key);
  if (it == snapshots_.end()) return;
  if (removed != nullptr) {
    removed->push_back({PrefixEvent::Kind::kRemoved, it->second.info.tokens,
                        it->second.info.route_hash});
  }
  held_ -= static_cast<int64_t>(it->second.info.bytes.size());
  lru_.erase({it->second.last_use, kSnapshotKind, key});
  snapshots_.erase(it);
}

void HostTier::DropSubtree(Hash h, std::vector<PrefixEvent>* removed) {
  std::vector<Hash> stack = {h};
  while (!stack.empty()) {
    const Hash x = stack.back();
    stack.pop_back();
    auto c = children_.find(x);
    if (c != children_.end()) {
      for (Hash child : c->second) stack.push_back(child);
    }
    DropSnapshot(x, removed);
    RemoveBlock(x);
    children_.erase(x);
  }
}

void HostTier::Touch(Hash h) {
  const uint64_t now = ++clock_;
  if (auto it = blocks_.find(h); it != blocks_.end()) {
    lru_.erase({it->second.last_use, kBlockKind, h});
    it->second.last_use = now;
    lru_.emplace(now, kBlockKind, h);
  }
  if (auto it = snapshots_.find(h); it != snapshots_.end()) {
    lru_.erase({it->second.last_use, kSnapshotKind, h});
    it->second.last_use = now;
    lru_.emplace(now, kSnapshotKind, h);
  }
}

void HostTier::Pin(absl::Span<const Hash> blocks, std::optional<Hash> snapshot) {
  pinned_blocks_.insert(blocks.begin(), blocks.end());
  if (snapshot.has_value()) pinned_snapshots_.insert(*snapshot);
}

void HostTier::UnpinAll() {
  pinned_blocks_.clear();
  pinned_snapshots_.clear();
}

void HostTier::Clear() {
  blocks_.clear();
  snapshots_.clear();
  children_.clear();
  lru_.clear();
  held_ = 0;
}

void HostTier::AppendStored(std::vector<PrefixEvent>* out) const {
  for (const auto& [key, s] : snapshots_) {
    out->push_back({PrefixEvent::Kind::kStored, s.info.tokens, s.info.route_hash});
  }
}

std::vector<std::pair<HostTier::Hash, HostTier::Hash>> HostTier::BlockParents() const {
  std::vector<std::pair<Hash, Hash>> out;
  for (const auto& [h, b] : blocks_) {
    if (b.has_parent) out.emplace_back(h, b.parent);
  }
  return out;
}

std::vector<HostTier::Hash> HostTier::SnapshotKeys() const {
  std::vector<Hash> out;
  for (const auto& [key, s] : snapshots_) out.push_back(key);
  return out;
}

absl::Status HostTier::CheckInvariants() const {
  int64_t bytes = 0;
  for (const auto& [h, b] : blocks_) {
    bytes += static_cast<int64_t>(b.bytes.size());
    if (!lru_.contains({b.last_use, kBlockKind, h})) {
      return Internal("host tier: block not in the LRU");
    }
    if (b.has_parent) {
      auto c = children_.find(b.parent);
      if (c == children_.end() || !c->second.contains(h)) {
        return Internal("host tier: block missing from its parent's children");
      }
    }
  }
  for (const auto& [key, s] : snapshots_) {
    bytes += static_cast<int64_t>(s.info.bytes.size());
    if (!lru_.contains({s.last_use, kSnapshotKind, key})) {
      return Internal("host tier: snapshot not in the LRU");
    }
  }
  size_t child_count = 0;
  for (const auto& [p, set] : children_) {
    for (Hash c : set) {
      auto it = blocks_.find(c);
      if (it == blocks_.end() || !it->second.has_parent || it->second.parent != p) {
        return Internal("host tier: a child index names no such block");
      }
    }
    child_count += set.size();
  }
  if (lru_.size() != blocks_.size() + snapshots_.size()) {
    return Internal("host tier: LRU has ", lru_.size(), " entries, ",
                    blocks_.size() + snapshots_.size(), " held");
  }
  if (bytes != held_)
    return Internal("host tier: ", held_, " bytes counted, ", bytes, " held");
  if (held_ > budget_)
    return Internal("host tier: ", held_, " bytes over budget ", budget_);
  (void)child_count;
  return absl::OkStatus();
}

}  // namespace tandem::engine
