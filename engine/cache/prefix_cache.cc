#include "engine/cache/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "common/status.h"

namespace tandem::engine {

std::vector<BlockHash> ChainedBlockHashes(absl::Span<const int32_t> tokens,
                                          int32_t block_size, std::string_view salt,
                                          absl::Span<const MediaHash> media) {
  std::vector<BlockHash> out;
  if (block_size <= 0) return out;
  const int64_t n = static_cast<int64_t>(tokens.size()) / block_size;
  out.reserve(n);
  // The chain's root is the salt's hash: another tenant's chain never meets it.
  BlockHash parent = XXH3_64bits(salt.data(), salt.size());
  std::vector<uint8_t> bytes;
  for (int64_t i = 0; i < n; ++i) {
    // This block's token ids, then (position, hash) of each media item in it;
    // seeded by the parent's hash (the chain).
    const auto* first =
        reinterpret_cast<const uint8_t*>(tokens.data() + i * block_size);
    bytes.assign(first, first + sizeof(int32_t) * static_cast<size_t>(block_size));
    for (const MediaHash& m : media) {
      if (m.position >= i * block_size && m.position < (i + 1) * block_size) {
        const uint64_t v[2] = {static_cast<uint64_t>(m.position), m.hash};
        const auto* b = reinterpret_cast<const uint8_t*>(v);
        bytes.insert(bytes.end(), b, b + sizeof(v));
      }
    }
    parent = XXH3_64bits_withSeed(bytes.data(), bytes.size(), parent);
    out.push_back(parent);
  }
  return out;
}

int64_t UsablePrefix(int64_t matched_blocks, int32_t block_size, int32_t kda_chunk,
                     int64_t prompt_tokens,
                     const std::function<bool(int64_t blocks)>& has_snapshot_at) {
  if (block_size <= 0 || kda_chunk <= 0) return 0;
  // Deepest first: the first k that satisfies every condition is the hit.
  for (int64_t k = matched_blocks; k > 0; --k) {
    const int64_t p = k * block_size;
    if (p >= prompt_tokens) continue;  // (d) one token left to compute
    if (p % kda_chunk != 0) continue;  // (c) bit-identical KDA state
    if (has_snapshot_at(k)) return p;  // (b) the state at exactly p
  }
  return 0;
}

std::vector<int64_t> SnapshotPositions(int64_t prompt_tokens, int64_t hit_tokens,
                                       int64_t matched_blocks, int32_t block_size,
                                       int32_t kda_chunk, int64_t grid) {
  std::vector<int64_t> out;
  if (block_size <= 0 || kda_chunk <= 0 || prompt_tokens <= 1) return out;
  const int64_t a = std::lcm<int64_t>(block_size, kda_chunk);
  auto add = [&](int64_t p) {
    p = p / a * a;
    if (p > hit_tokens && p < prompt_tokens) out.push_back(p);
  };
  add(prompt_tokens - 1);  // the last full chunk below the last token
  add(matched_blocks * block_size);
  if (grid > 0) {
    const int64_t g = (grid + a - 1) / a * a;  // the grid on aligned positions
    for (int64_t p = g; p < prompt_tokens; p += g) add(p);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

PrefixCache::PrefixCache(const PrefixCacheConfig& config, BlockAllocator* blocks)
    : config_(config), blocks_(blocks) {
  for (SnapshotId s = config.num_snapshots - 1; s >= 0; --s) {
    free_snapshots_.push_back(s);
  }
}

void PrefixCache::RecordLookup(int64_t prompt_tokens, int64_t hit_tokens) {
  ++stats_.lookups;
  stats_.hits += hit_tokens > 0;
  stats_.queried_tokens += prompt_tokens;
  stats_.hit_tokens += hit_tokens;
}

PrefixHit PrefixCache::Lookup(absl::Span<const BlockHash> hashes, int64_t prompt_tokens,
                              bool record) {
  PrefixHit hit;
  const uint64_t now = ++clock_;
  int64_t k = 0;
  while (k < static_cast<int64_t>(hashes.size())) {
    auto it = entries_.find(hashes[k]);
    if (it == entries_.end()) break;
    it->second.last_use = now;
    ++k;
  }
  const int64_t on_device = k;
  // The chain continues in the host tier (device blocks are prefix-closed: a
  // block's parent is on the device, so the host holds the deeper part).
  while (host_ != nullptr && k < static_cast<int64_t>(hashes.size()) &&
         host_->HasBlock(hashes[k])) {
    ++k;
  }
  hit.matched_blocks = k;
  hit.tokens = UsablePrefix(k, config_.block_size, config_.kda_chunk, prompt_tokens,
                            [&](int64_t b) { return HasSnapshot(hashes[b - 1]); });
  if (hit.tokens > 0) {
    int64_t nb = hit.tokens / config_.block_size;
    if (nb > on_device || !snapshots_.contains(hashes[nb - 1])) {
      if (LoadFromHost(hashes, on_device, nb, now)) {
        ++stats_.hits_from_host;
      } else {
        // What is usable from the device tier alone (loads that happened stay).
        ++stats_.host_load_failures;
        int64_t d = 0;
        while (d < static_cast<int64_t>(hashes.size()) &&
               entries_.contains(hashes[d])) {
          ++d;
        }
        hit.tokens =
            UsablePrefix(d, config_.block_size, config_.kda_chunk, prompt_tokens,
                         [&](int64_t b) { return snapshots_.contains(hashes[b - 1]); });
        nb = hit.tokens / config_.block_size;
      }
    }
    if (hit.tokens > 0) {
      for (int64_t i = 0; i < nb; ++i) hit.blocks.push_back(entries_[hashes[i]].block);
      Snapshot& s = snapshots_[hashes[nb - 1]];
      s.last_use = now;
      hit.snapshot = s.id;
    }
  }
  if (record) RecordLookup(prompt_tokens, hit.tokens);
  return hit;
}

std::vector<BlockId> PrefixCache::MatchBlocks(absl::Span<const BlockHash> hashes,
                                              int64_t max_blocks,
                                              int64_t queried_tokens) {
  std::vector<BlockId> out;
  const uint64_t now = ++clock_;
  const int64_t limit =
      std::min<int64_t>(max_blocks, static_cast<int64_t>(hashes.size()));
  for (int64_t k = 0; k < limit; ++k) {
    auto it = entries_.find(hashes[k]);
    if (it == entries_.end()) break;
    it->second.last_use = now;
    out.push_back(it->second.block);
  }
  stats_.reserve_queried_tokens += queried_tokens;
  stats_.reserve_hit_tokens += static_cast<int64_t>(out.size()) * config_.block_size;
  return out;
}

bool PrefixCache::AnnounceBlocks(BlockHash key, int64_t tokens, uint64_t route_hash) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.announced_tokens > 0 || tokens <= 0) {
    return false;
  }
  it->second.announced_tokens = tokens;
  it->second.announced_route_hash = route_hash;
  Publish({PrefixEvent::Kind::kStored, tokens, route_hash, /*blocks_only=*/true});
  return true;
}

bool PrefixCache::FreeOneForLoad(uint64_t now) {
  if (blocks_->num_free() > 0) return true;
  const BlockHash* victim = nullptr;
  uint64_t best = 0;
  for (const auto& [h, e] : entries_) {
    if (e.children != 0 || e.last_use == now || blocks_->ref_count(e.block) != 1) {
      continue;
    }
    if (victim == nullptr || e.last_use < best) {
      victim = &h;
      best = e.last_use;
    }
  }
  if (victim == nullptr) return false;
  Evict(*victim);
  return blocks_->num_free() > 0;
}

bool PrefixCache::LoadFromHost(absl::Span<const BlockHash> hashes, int64_t first,
                               int64_t blocks, uint64_t now) {
  if (host_ == nullptr || !copier_.load_block || !copier_.load_snapshot) return false;
  const BlockHash key = hashes[blocks - 1];
  host_->Pin(hashes.subspan(first, blocks - first), key);
  bool ok = true;
  for (int64_t i = first; i < blocks && ok; ++i) {
    const BlockHash h = hashes[i];
    if (entries_.contains(h)) continue;
    if (!host_->HasBlock(h) || !FreeOneForLoad(now)) {
      ok = false;
      break;
    }
    absl::StatusOr<BlockId> id = blocks_->Allocate();
    if (!id.ok()) {
      ok = false;
      break;
    }
    std::optional<std::vector<uint8_t>> bytes = host_->TakeBlock(h);
    if (!copier_.load_block(*id, *bytes).ok()) {
      // The bytes are lost: the block is gone from both tiers, and so is
      // whatever hung below it on the host.
      blocks_->Free(*id).IgnoreError();
      std::vector<PrefixEvent> removed;
      host_->DropSubtree(h, &removed);
      PublishAll(removed);
      ok = false;
      break;
    }
    Entry e;
    e.block = *id;
    if (i > 0) {
      e.parent = hashes[i - 1];
      e.has_parent = true;
      ++entries_[e.parent].children;
    }
    e.last_use = now;
    entries_.emplace(h, e);
    by_block_.emplace(*id, h);
    ++stats_.blocks_loaded_from_host;
  }
  if (ok && !snapshots_.contains(key)) {
    if (!host_->HasSnapshot(key)) {
      ok = false;
    } else {
      if (free_snapshots_.empty()) {
        auto lru = std::min_element(snapshots_.begin(), snapshots_.end(),
                                    [](const auto& a, const auto& b) {
                                      return a.second.last_use < b.second.last_use;
                                    });
        if (lru != snapshots_.end()) DemoteSnapshot(lru->first);
      }
      if (free_snapshots_.empty()) {
        ok = false;
      } else {
        std::optional<HostTier::SnapshotInfo> info = host_->TakeSnapshot(key);
        const SnapshotId sid = free_snapshots_.back();
        if (!copier_.load_snapshot(sid, info->bytes).ok()) {
          Publish({PrefixEvent::Kind::kRemoved, info->tokens, info->route_hash});
          ok = false;
        } else {
          free_snapshots_.pop_back();
          Snapshot s;
          s.id = sid;
          s.last_use = now;
          s.tokens = info->tokens;
          s.route_hash = info->route_hash;
          snapshots_.emplace(key, s);
          ++stats_.snapshots_loaded_from_host;
        }
      }
    }
  }
  host_->UnpinAll();
  return ok;
}

bool PrefixCache::InsertBlock(absl::Span<const BlockHash> hashes, int64_t index,
                              BlockId id) {
  if (index < 0 || index >= static_cast<int64_t>(hashes.size())) return false;
  const BlockHash h = hashes[index];
  if (entries_.contains(h) || by_block_.contains(id)) return false;
  Entry e;
  e.block = id;
  if (index > 0) {
    auto parent = entries_.find(hashes[index - 1]);
    if (parent == entries_.end()) return false;  // chains stay contiguous
    e.parent = hashes[index - 1];
    e.has_parent = true;
    ++parent->second.children;
  }
  if (!blocks_->IncRef(id).ok()) {  // a free block: a caller bug, not cached
    if (e.has_parent) --entries_[e.parent].children;
    return false;
  }
  // Computed again while a copy sat on the host: the device copy replaces it
  // (its children there keep it as their parent).
  if (InHost(h)) host_->TakeBlock(h);
  e.last_use = ++clock_;
  entries_.emplace(h, e);
  by_block_.emplace(id, h);
  ++stats_.blocks_inserted;
  return true;
}

absl::StatusOr<SnapshotId> PrefixCache::StoreSnapshot(BlockHash key, int64_t tokens,
                                                      uint64_t route_hash) {
  if (config_.num_snapshots <= 0) return FailedPrecondition("no snapshot pool");
  if (!entries_.contains(key)) {
    return NotFound("snapshot key names no cached block");
  }
  if (snapshots_.contains(key)) {
    return absl::AlreadyExistsError("a snapshot exists at this position");
  }
  // A copy on the host (this state was recomputed): the device one replaces
  // it, and the prefix was usable all along (no kStored again).
  const bool was_on_host = host_ != nullptr && host_->TakeSnapshot(key).has_value();
  if (free_snapshots_.empty()) {
    auto lru = std::min_element(snapshots_.begin(), snapshots_.end(),
                                [](const auto& a, const auto& b) {
                                  return a.second.last_use < b.second.last_use;
                                });
    DemoteSnapshot(lru->first);
  }
  Snapshot s;
  s.id = free_snapshots_.back();
  free_snapshots_.pop_back();
  s.last_use = ++clock_;
  s.tokens = tokens;
  s.route_hash = route_hash;
  snapshots_.emplace(key, s);
  ++stats_.snapshots_stored;
  if (!was_on_host) Publish({PrefixEvent::Kind::kStored, tokens, route_hash});
  return s.id;
}

void PrefixCache::Publish(const PrefixEvent& e) {
  if (events_ == nullptr) return;
  events_->Push(e, [this] { return ResyncEvents(); });
}

void PrefixCache::PublishAll(const std::vector<PrefixEvent>& events) {
  for (const PrefixEvent& e : events) Publish(e);
}

void PrefixCache::DemoteSnapshot(BlockHash key) {
  auto it = snapshots_.find(key);
  if (it == snapshots_.end()) return;
  ++stats_.snapshots_evicted;
  std::vector<uint8_t> bytes;
  if (host_ != nullptr && copier_.save_snapshot &&
      copier_.save_snapshot(it->second.id, &bytes).ok()) {
    std::vector<PrefixEvent> removed;
    const bool moved = host_->PutSnapshot(key, it->second.tokens, it->second.route_hash,
                                          std::move(bytes), &removed);
    PublishAll(removed);
    if (moved) {
      ++stats_.snapshots_moved_to_host;
      free_snapshots_.push_back(it->second.id);
      snapshots_.erase(it);
      return;  // still usable: no event
    }
  }
  DropSnapshot(key);
}

std::vector<PrefixEvent> PrefixCache::ResyncEvents() const {
  std::vector<PrefixEvent> out;
  out.reserve(snapshots_.size() + 1);
  out.push_back({PrefixEvent::Kind::kCleared, 0, 0});
  for (const auto& [key, s] : snapshots_) {
    out.push_back({PrefixEvent::Kind::kStored, s.tokens, s.route_hash});
  }
  for (const auto& [h, e] : entries_) {
    if (e.announced_tokens > 0) {
      out.push_back({PrefixEvent::Kind::kStored, e.announced_tokens,
                     e.announced_route_hash, /*blocks_only=*/true});
    }
  }
  if (host_ != nullptr) host_->AppendStored(&out);
  std::sort(out.begin() + 1, out.end(), [](const PrefixEvent& a, const PrefixEvent& b) {
    if (a.tokens != b.tokens) return a.tokens < b.tokens;
    if (a.route_hash != b.route_hash) return a.route_hash < b.route_hash;
    return a.blocks_only < b.blocks_only;
  });
  return out;
}

void PrefixCache::DropSnapshot(BlockHash key) {
  auto it = snapshots_.find(key);
  if (it == snapshots_.end()) return;
  const PrefixEvent removed{PrefixEvent::Kind::kRemoved, it->second.tokens,
                            it->second.route_hash};
  free_snapshots_.push_back(it->second.id);
  snapshots_.erase(it);
  Publish(removed);
}

void PrefixCache::Evict(BlockHash h) {
  auto it = entries_.find(h);
  if (it == entries_.end()) return;
  const Entry e = it->second;
  // Off the device tier: a reservation can no longer share it.
  if (e.announced_tokens > 0) {
    Publish({PrefixEvent::Kind::kRemoved, e.announced_tokens, e.announced_route_hash,
             /*blocks_only=*/true});
  }
  if (e.has_parent) {
    auto parent = entries_.find(e.parent);
    if (parent != entries_.end()) --parent->second.children;
  }
  // To the host tier when it takes the block (and then the snapshot at its
  // end, if any: it stays usable); else both go, with whatever the host held
  // below this block (unreachable from now on).
  bool moved = false;
  if (host_ != nullptr && copier_.save_block) {
    std::vector<uint8_t> bytes;
    if (copier_.save_block(e.block, &bytes).ok()) {
      std::vector<PrefixEvent> removed;
      moved = host_->PutBlock(h, e.parent, e.has_parent, std::move(bytes), &removed);
      PublishAll(removed);
    }
  }
  if (moved) {
    ++stats_.blocks_moved_to_host;
    if (snapshots_.contains(h)) DemoteSnapshot(h);
  } else {
    if (snapshots_.contains(h)) {
      DropSnapshot(h);
      ++stats_.snapshots_evicted;
    }
    if (host_ != nullptr) {
      std::vector<PrefixEvent> removed;
      host_->DropSubtree(h, &removed);
      PublishAll(removed);
    }
  }
  by_block_.erase(e.block);
  entries_.erase(h);
  blocks_->Free(e.block).IgnoreError();  // the cache's reference
  ++stats_.blocks_evicted;
}

int64_t PrefixCache::Reclaim(int64_t free_blocks) {
  int64_t evicted = 0;
  if (blocks_->num_free() >= free_blocks) return 0;
  // Unreferenced leaves, least recently used first; a parent whose last child
  // goes becomes a leaf and joins in its own LRU place (strict LRU over leaves).
  std::set<std::pair<uint64_t, BlockHash>> leaves;
  auto evictable_leaf = [&](const Entry& e) {
    return e.children == 0 && blocks_->ref_count(e.block) == 1;
  };
  for (const auto& [h, e] : entries_) {
    if (evictable_leaf(e)) leaves.emplace(e.last_use, h);
  }
  while (blocks_->num_free() < free_blocks && !leaves.empty()) {
    const BlockHash h = leaves.begin()->second;
    leaves.erase(leaves.begin());
    const Entry e = entries_.at(h);
    Evict(h);
    ++evicted;
    if (e.has_parent) {
      auto parent = entries_.find(e.parent);
      if (parent != entries_.end() && evictable_leaf(parent->second)) {
        leaves.emplace(parent->second.last_use, e.parent);
      }
    }
  }
  return evicted;
}

void PrefixCache::Clear() {
  for (const auto& [h, e] : entries_) blocks_->Free(e.block).IgnoreError();
  entries_.clear();
  by_block_.clear();
  for (const auto& [key, s] : snapshots_) free_snapshots_.push_back(s.id);
  snapshots_.clear();
  if (host_ != nullptr) host_->Clear();
  Publish({PrefixEvent::Kind::kCleared, 0, 0});
}

int64_t PrefixCache::num_evictable_blocks() const {
  int64_t n = 0;
  for (const auto& [h, e] : entries_) n += blocks_->ref_count(e.block) == 1;
  return n;
}

absl::Status PrefixCache::CheckInvariants() const {
  if (by_block_.size() != entries_.size()) {
    return Internal("prefix cache: ", entries_.size(), " entries, ", by_block_.size(),
                    " blocks");
  }
  absl::flat_hash_map<BlockHash, int32_t> children;
  for (const auto& [h, e] : entries_) {
    if (blocks_->ref_count(e.block) < 1) {
      return Internal("prefix cache holds free block ", e.block);
    }
    auto b = by_block_.find(e.block);
    if (b == by_block_.end() || b->second != h) {
      return Internal("prefix cache: block ", e.block, " indexed wrongly");
    }
    if (e.has_parent) {
      if (!entries_.contains(e.parent)) {
        return Internal("prefix cache: block ", e.block, " has no cached parent");
      }
      ++children[e.parent];
    }
  }
  for (const auto& [h, e] : entries_) {
    const auto c = children.find(h);
    if ((c == children.end() ? 0 : c->second) != e.children) {
      return Internal("prefix cache: block ", e.block, " children count wrong");
    }
  }
  absl::flat_hash_map<SnapshotId, int> ids;
  for (const auto& [key, s] : snapshots_) {
    if (!entries_.contains(key)) return Internal("snapshot without its block");
    if (s.id < 0 || s.id >= config_.num_snapshots || ids[s.id]++ > 0) {
      return Internal("snapshot id ", s.id, " bad or used twice");
    }
  }
  for (SnapshotId s : free_snapshots_) {
    if (ids[s]++ > 0) return Internal("snapshot id ", s, " both free and used");
  }
  if (host_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(host_->CheckInvariants());
    // Device blocks are prefix-closed (checked above); host blocks hang below a
    // block of either tier, and a host snapshot's block is in one of them.
    for (const auto& [h, parent] : host_->BlockParents()) {
      if (entries_.contains(h)) return Internal("block in both tiers");
      if (!entries_.contains(parent) && !host_->HasBlock(parent)) {
        return Internal("host block whose parent is in neither tier");
      }
    }
    for (BlockHash key : host_->SnapshotKeys()) {
      if (snapshots_.contains(key)) return Internal("snapshot in both tiers");
      if (!entries_.contains(key) && !host_->HasBlock(key)) {
        return Internal("host snapshot whose block is in neither tier");
      }
    }
  }
  if (static_cast<int32_t>(snapshots_.size() + free_snapshots_.size()) !=
      config_.num_snapshots) {
    return Internal("snapshot pool: ", snapshots_.size(), " used + ",
                    free_snapshots_.size(), " free != ", config_.num_snapshots);
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
