#include "kvtransfer/host_staging_agent.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/wire.h"

namespace tandem::kvtransfer {
namespace {

// Marks a notification sent after direct writes (the receiver strips it and
// sets Notification::on_device).
constexpr absl::string_view kDirectMark = "\x1btandem-direct\x1b";
// The kExtensionDeviceIpc extension: u32 count, per region u32 id, u64 length,
// u32 handle length, handle (little-endian).
constexpr size_t kMaxIpcHandleBytes = 4096;

Notification Unmark(Notification n) {
  if (absl::StartsWith(n.payload, kDirectMark)) {
    n.payload.erase(0, kDirectMark.size());
    n.on_device = true;
  }
  return n;
}

}  // namespace

absl::StatusOr<KvBuffer> ParseKvBuffer(absl::string_view spec) {
  if (spec == "auto") return KvBuffer::kAuto;
  if (spec == "device") return KvBuffer::kDevice;
  if (spec == "host") return KvBuffer::kHost;
  return InvalidArgument("--kv_buffer must be auto, device or host, got '", spec, "'");
}

const char* KvBufferName(KvBuffer buffer) {
  switch (buffer) {
    case KvBuffer::kAuto:
      return "auto";
    case KvBuffer::kDevice:
      return "device";
    case KvBuffer::kHost:
      return "host";
  }
  return "auto";
}

HostStagingAgent::HostStagingAgent(std::unique_ptr<TransferAgent> inner,
                                   HostStagingOptions options)
    : inner_(std::move(inner)),
      options_(options),
      release_pages_(options.release_pages),
      page_(static_cast<uint64_t>(sysconf(_SC_PAGESIZE))) {}

HostStagingAgent::~HostStagingAgent() {
  // The inner agent forgets the shadows before they are unmapped.
  absl::flat_hash_map<RegionId, Staged> staged;
  {
    absl::MutexLock l(&mu_);
    staged.swap(staged_);
  }
  for (auto& [id, s] : staged) {
    inner_->DeregisterMemory(id).IgnoreError();
  }
  // The inner agent goes first: its progress thread may be in a completion
  // callback (ReleaseGranules) that uses this object's members, and a batch
  // still live may read a shadow.
  inner_.reset();
  {
    absl::MutexLock l(&mu_);
    direct_.clear();  // closes the peers' mappings
  }
  for (auto& [id, s] : staged) munmap(s.shadow, s.mapped);
}

HostStagingAgent::PeerMapping::~PeerMapping() {
  for (auto& [id, m] : regions) copier->CloseIpc(m.base);
}

absl::StatusOr<RegionId> HostStagingAgent::RegisterStaged(
    void* device_base, size_t len, std::shared_ptr<StagingCopier> copier) {
  if (device_base == nullptr || len == 0) {
    return InvalidArgument("a staged region needs memory (",
                           device_base == nullptr ? "null base" : "empty", ")");
  }
  if (copier == nullptr) return InvalidArgument("a staged region needs a copier");
  const size_t mapped = (len + page_ - 1) / page_ * page_;
  // Reserved with a huge page's slack, so that the shadow starts on a 2 MiB
  // boundary (huge pages need one); the slack is unmapped at once.
  constexpr size_t kHuge = size_t{2} << 20;
  void* reserved = mmap(nullptr, mapped + kHuge, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* shadow = reserved;
  if (reserved != MAP_FAILED) {
    auto* r = static_cast<uint8_t*>(reserved);
    auto* aligned = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(r) + kHuge - 1) & ~uintptr_t{kHuge - 1});
    if (aligned > r) munmap(r, aligned - r);
    const size_t tail = (r + mapped + kHuge) - (aligned + mapped);
    if (tail > 0) munmap(aligned + mapped, tail);
    shadow = aligned;
  }
  if (shadow == MAP_FAILED) {
    return ResourceExhausted("cannot reserve ", mapped,
                             " bytes of address space for the host staging of ",
                             copier->DeviceName(), " memory: ", std::strerror(errno));
  }
  // Transparent huge pages where the kernel offers them (madvise mode): a
  // shadow page is faulted in as its bytes arrive, 2 MiB at a time instead of
  // 4 KiB (faults are slow in VMs: ~20 us per 4 KiB page measured here).
  madvise(shadow, mapped, MADV_HUGEPAGE);
  absl::StatusOr<RegionId> id = inner_->RegisterMemory(shadow, len, MemoryKind::Host());
  if (!id.ok()) {
    munmap(shadow, mapped);
    return id.status();
  }
  // Published for peers of this host to write into directly, where the device
  // can share it.
  absl::StatusOr<std::string> handle = std::string();
  if (options_.device_ipc && publish_ipc_.load()) {
    handle = copier->ExportIpc(device_base, len);
  }
  absl::MutexLock l(&mu_);
  if (!handle.ok() && export_status_.ok()) {
    export_status_ = absl::Status(
        handle.status().code(),
        absl::StrCat("cannot share ", copier->DeviceName(),
                     " memory with other processes: ", handle.status().message()));
  }
  if (handle.ok() && !handle->empty()) ++stats_.exported_regions;
  staged_[*id] = Staged{static_cast<uint8_t*>(device_base),
                        static_cast<uint8_t*>(shadow),
                        len,
                        mapped,
                        std::move(copier),
                        handle.ok() ? *std::move(handle) : std::string()};
  ++stats_.staged_regions;
  stats_.shadow_bytes += len;
  return *id;
}

bool HostStagingAgent::IsStaged(RegionId region) const {
  absl::MutexLock l(&mu_);
  return staged_.contains(region);
}

bool HostStagingAgent::IsDirect(PeerId peer) const {
  absl::MutexLock l(&mu_);
  return direct_.contains(peer);
}

absl::Status HostStagingAgent::ipc_export_status() const {
  absl::MutexLock l(&mu_);
  return export_status_;
}

absl::Status HostStagingAgent::last_direct_refusal() const {
  absl::MutexLock l(&mu_);
  return last_direct_refusal_;
}

HostStagingStats HostStagingAgent::stats() const {
  absl::MutexLock l(&mu_);
  HostStagingStats s = stats_;
  s.direct_peers = direct_.size();
  return s;
}

void HostStagingAgent::DropPages(const Staged& s, uint64_t begin, uint64_t end) {
  if (!release_pages_.load()) return;
  begin = (begin + page_ - 1) / page_ * page_;
  end = std::min<uint64_t>(end, s.mapped) / page_ * page_;
  if (end <= begin) return;
  if (madvise(s.shadow + begin, end - begin, MADV_DONTNEED) == 0) {
    stats_.pages_released += (end - begin) / page_;
  }
}

void HostStagingAgent::set_release_pages(bool release) {
  absl::MutexLock l(&mu_);
  if (release && !release_pages_.load()) {
    for (auto& [id, s] : staged_) madvise(s.shadow, s.mapped, MADV_NOHUGEPAGE);
  }
  release_pages_.store(release);
}

absl::StatusOr<uint64_t> HostStagingAgent::RunCopies(std::vector<PendingCopy> copies,
                                                     bool to_device) {
  // Grouped by copier (one device each), in order within a group.
  absl::flat_hash_map<StagingCopier*, std::vector<StagingCopy>> groups;
  std::vector<std::shared_ptr<StagingCopier>> keep;  // alive across the copies
  std::vector<RegionId> regions;
  {
    absl::MutexLock l(&mu_);
    for (const PendingCopy& c : copies) {
      auto it = staged_.find(c.region);
      if (it == staged_.end()) {  // deregistered since the caller checked
        for (RegionId r : regions) {
          if (--busy_[r] == 0) busy_.erase(r);
        }
        return FailedPrecondition("host-staged region ", c.region,
                                  " was deregistered during the transfer");
      }
      auto [g, fresh] = groups.try_emplace(it->second.copier.get());
      if (fresh) keep.push_back(it->second.copier);
      g->second.push_back(c.copy);
      if (regions.empty() || regions.back() != c.region) {
        regions.push_back(c.region);
        ++busy_[c.region];
      }
    }
  }
  const absl::Time start = absl::Now();
  absl::Status status;
  uint64_t bytes = 0;
  for (auto& [copier, batch] : groups) {
    status = to_device ? copier->ToDevice(batch) : copier->ToHost(batch);
    if (!status.ok()) break;
    for (const StagingCopy& c : batch) bytes += c.bytes;
  }
  absl::MutexLock l(&mu_);
  for (RegionId r : regions) {
    if (--busy_[r] == 0) busy_.erase(r);
  }
  if (!status.ok()) return status;
  (to_device ? stats_.bytes_to_device : stats_.bytes_to_host) += bytes;
  stats_.copy_micros += absl::ToInt64Microseconds(absl::Now() - start);
  return bytes;
}

absl::Status HostStagingAgent::StageIn(absl::Span<const ByteRange> ranges) {
  std::vector<PendingCopy> copies;
  {
    absl::MutexLock l(&mu_);
    for (const ByteRange& r : ranges) {
      auto it = staged_.find(r.region);
      if (it == staged_.end()) {
        return InvalidArgument("stage-in of region ", r.region,
                               ", which is not a host-staged region");
      }
      const Staged& s = it->second;
      if (r.offset > s.len || r.length > s.len - r.offset) {
        return InvalidArgument("stage-in of [", r.offset, ", +", r.length,
                               ") outside region ", r.region, " of ", s.len, " bytes");
      }
      if (r.length == 0) continue;
      copies.push_back(
          {r.region, StagingCopy{s.device + r.offset, s.shadow + r.offset, r.length}});
    }
  }
  TANDEM_RETURN_IF_ERROR(RunCopies(std::move(copies), /*to_device=*/true).status());
  DropRanges(ranges);
  return absl::OkStatus();
}

absl::Status HostStagingAgent::Discard(absl::Span<const ByteRange> ranges) {
  {
    absl::MutexLock l(&mu_);
    for (const ByteRange& r : ranges) {
      auto it = staged_.find(r.region);
      if (it == staged_.end()) {
        return InvalidArgument("discard of region ", r.region,
                               ", which is not a host-staged region");
      }
      if (r.offset > it->second.len || r.length > it->second.len - r.offset) {
        return InvalidArgument("discard of [", r.offset, ", +", r.length,
                               ") outside region ", r.region, " of ", it->second.len,
                               " bytes");
      }
    }
  }
  DropRanges(ranges);
  return absl::OkStatus();
}

void HostStagingAgent::DropRanges(absl::Span<const ByteRange> ranges) {
  if (!release_pages_.load()) return;
  absl::MutexLock l(&mu_);
  // Only pages wholly inside the ranges, and none a sender's batch reads.
  // Adjacent ranges are merged first (a request's blocks are often
  // consecutive), so that a page split between two of them goes too and one
  // madvise covers a run: each call costs far more than its pages (UCX's
  // memory hooks see every one).
  std::vector<ByteRange> sorted(ranges.begin(), ranges.end());
  std::sort(sorted.begin(), sorted.end(), [](const ByteRange& a, const ByteRange& b) {
    return a.region != b.region ? a.region < b.region : a.offset < b.offset;
  });
  std::vector<ByteRange> runs;
  for (const ByteRange& r : sorted) {
    if (r.length == 0) continue;
    if (!runs.empty() && runs.back().region == r.region &&
        runs.back().offset + runs.back().length >= r.offset) {
      runs.back().length =
          std::max(runs.back().offset + runs.back().length, r.offset + r.length) -
          runs.back().offset;
    } else {
      runs.push_back(r);
    }
  }
  for (const ByteRange& r : runs) {
    auto it = staged_.find(r.region);
    if (it == staged_.end()) continue;
    const uint64_t begin = r.offset, end = r.offset + r.length;
    const uint64_t g0 = begin / kGranule, g1 = (end - 1) / kGranule;
    // Split around granules a sender's batch still reads.
    uint64_t from = begin;
    for (uint64_t g = g0; g <= g1; ++g) {
      if (!in_flight_.contains(GranuleKey{r.region, g})) continue;
      DropPages(it->second, from, std::max(from, g * kGranule));
      from = std::min(end, (g + 1) * kGranule);
    }
    DropPages(it->second, from, end);
  }
}

void HostStagingAgent::ReleaseGranules(const std::vector<GranuleKey>& granules) {
  // The granules at zero, merged into runs (one madvise each).
  std::vector<GranuleKey> free;
  absl::MutexLock l(&mu_);
  for (const GranuleKey& k : granules) {
    auto it = in_flight_.find(k);
    if (it == in_flight_.end()) continue;
    if (--it->second > 0) continue;
    in_flight_.erase(it);
    free.push_back(k);
  }
  std::sort(free.begin(), free.end());
  for (size_t i = 0; i < free.size();) {
    size_t j = i + 1;
    while (j < free.size() && free[j].first == free[i].first &&
           free[j].second == free[j - 1].second + 1) {
      ++j;
    }
    auto s = staged_.find(free[i].first);
    if (s != staged_.end()) {
      DropPages(s->second, free[i].second * kGranule,
                (free[j - 1].second + 1) * kGranule);
    }
    i = j;
  }
}

absl::StatusOr<BatchId> HostStagingAgent::PostWrite(PeerId peer,
                                                    absl::Span<const Segment> segments,
                                                    CompletionCallback on_done) {
  if (IsDirect(peer)) return PostDirect(peer, segments, std::move(on_done));
  return PostStaged(peer, segments, std::move(on_done));
}

absl::StatusOr<BatchId> HostStagingAgent::PostStaged(PeerId peer,
                                                     absl::Span<const Segment> segments,
                                                     CompletionCallback on_done) {
  std::vector<PendingCopy> copies;
  auto granules = std::make_shared<std::vector<GranuleKey>>();
  {
    absl::MutexLock l(&mu_);
    // Checked whole first: nothing is counted or copied for a refused batch.
    for (const Segment& g : segments) {
      auto it = staged_.find(g.local_region);
      if (it == staged_.end()) continue;
      const Staged& s = it->second;
      if (g.local_offset > s.len || g.length > s.len - g.local_offset) {
        return InvalidArgument("segment [", g.local_offset, ", +", g.length,
                               ") outside local region ", g.local_region, " of ", s.len,
                               " bytes");
      }
    }
    for (const Segment& g : segments) {
      auto it = staged_.find(g.local_region);
      if (it == staged_.end() || g.length == 0) continue;
      const Staged& s = it->second;
      copies.push_back(
          {g.local_region, StagingCopy{s.shadow + g.local_offset,
                                       s.device + g.local_offset, g.length}});
      const uint64_t g0 = g.local_offset / kGranule;
      const uint64_t g1 = (g.local_offset + g.length - 1) / kGranule;
      for (uint64_t k = g0; k <= g1; ++k) {
        ++in_flight_[GranuleKey{g.local_region, k}];
        granules->push_back(GranuleKey{g.local_region, k});
      }
    }
  }
  if (copies.empty()) return inner_->PostWrite(peer, segments, std::move(on_done));
  if (absl::StatusOr<uint64_t> copied =
          RunCopies(std::move(copies), /*to_device=*/false);
      !copied.ok()) {
    ReleaseGranules(*granules);
    return absl::Status(copied.status().code(),
                        absl::StrCat("staging the KV through host memory: ",
                                     copied.status().message()));
  }
  absl::StatusOr<BatchId> batch = inner_->PostWrite(
      peer, segments,
      [this, granules, on_done = std::move(on_done)](BatchId b, const absl::Status& s) {
        ReleaseGranules(*granules);
        if (on_done) on_done(b, s);
      });
  // Refused at posting: no completion will come.
  if (!batch.ok()) ReleaseGranules(*granules);
  return batch;
}

absl::StatusOr<std::shared_ptr<HostStagingAgent::DirectPeer>> HostStagingAgent::MapPeer(
    const AgentDescriptor& descriptor, absl::string_view extension,
    const std::vector<std::shared_ptr<StagingCopier>>& copiers) {
  // The extension: (id, length, handle) per region, checked whole first.
  struct Entry {
    RegionId id;
    uint64_t len;
    absl::string_view handle;
  };
  std::vector<Entry> entries;
  absl::string_view in = extension;
  uint64_t count = 0;
  if (!GetLe(&in, 4, &count) || count == 0 || count > kMaxDescriptorRegions) {
    return InvalidArgument("malformed device IPC extension (region count ", count, ")");
  }
  absl::flat_hash_set<RegionId> seen;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t id = 0, len = 0, handle_len = 0;
    if (!GetLe(&in, 4, &id) || !GetLe(&in, 8, &len) || !GetLe(&in, 4, &handle_len) ||
        handle_len == 0 || handle_len > kMaxIpcHandleBytes || handle_len > in.size() ||
        len == 0) {
      return InvalidArgument("malformed device IPC extension (region ", i, ")");
    }
    if (!seen.insert(static_cast<RegionId>(id)).second) {
      return InvalidArgument("device IPC extension lists region ", id, " twice");
    }
    const RegionDescriptor* r = descriptor.FindRegion(static_cast<RegionId>(id));
    if (r == nullptr || r->length != len) {
      return InvalidArgument(
          "device IPC extension lists region ", id, " of ", len,
          " bytes, which the descriptor ",
          r == nullptr ? "does not have" : absl::StrCat("has with ", r->length));
    }
    entries.push_back({static_cast<RegionId>(id), len, in.substr(0, handle_len)});
    in.remove_prefix(handle_len);
  }
  if (!in.empty()) {
    return InvalidArgument("malformed device IPC extension (", in.size(),
                           " trailing bytes)");
  }
  auto peer = std::make_shared<DirectPeer>();
  for (const RegionDescriptor& r : descriptor.regions) peer->lengths[r.id] = r.length;
  for (const std::shared_ptr<StagingCopier>& copier : copiers) {
    if (peer->by_copier.contains(copier.get())) continue;
    auto mapping = std::make_unique<PeerMapping>();
    mapping->copier = copier;
    for (const Entry& e : entries) {
      TANDEM_ASSIGN_OR_RETURN(void* base, copier->OpenIpc(e.handle));
      mapping->regions[e.id] = {static_cast<uint8_t*>(base), e.len};
    }
    if (peer->first == nullptr) peer->first = mapping.get();
    peer->by_copier[copier.get()] = std::move(mapping);
  }
  if (peer->first == nullptr) return InvalidArgument("no copier to map the peer with");
  return peer;
}

uint64_t HostStagingAgent::LocalLengthLocked(RegionId region) const {
  if (auto st = staged_.find(region); st != staged_.end()) return st->second.len;
  if (auto pt = pass_through_.find(region); pt != pass_through_.end()) {
    return pt->second.len;
  }
  return 0;
}

absl::StatusOr<BatchId> HostStagingAgent::PostDirect(PeerId peer,
                                                     absl::Span<const Segment> segments,
                                                     CompletionCallback on_done) {
  // Segments into the peer's mapped device memory are copied here: from a
  // staged region by its own device (device to device, into that device's
  // mapping), from a host region host to device; the rest (regions the peer
  // did not publish) go the usual way, as the batch posted below.
  struct Group {
    PeerMapping* mapping = nullptr;
    std::vector<StagingCopy> d2d, h2d;
  };
  std::shared_ptr<DirectPeer> target;
  absl::flat_hash_map<StagingCopier*, Group> groups;
  std::vector<Segment> rest;
  std::vector<RegionId> busy;
  uint64_t bytes = 0;
  {
    absl::MutexLock l(&mu_);
    auto p = direct_.find(peer);
    if (p == direct_.end())
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    target = p->second;
    const PeerMapping& any = *target->first;
    for (const Segment& g : segments) {
      if (g.length == 0) return InvalidArgument("a segment of 0 bytes");
      auto m = any.regions.find(g.remote_region);
      if (m == any.regions.end()) {
        // Checked here too, so that nothing is copied for a batch the inner
        // agent would refuse.
        auto rl = target->lengths.find(g.remote_region);
        const uint64_t local_len = LocalLengthLocked(g.local_region);
        if (rl == target->lengths.end() || local_len == 0 ||
            g.remote_offset > rl->second || g.length > rl->second - g.remote_offset ||
            g.local_offset > local_len || g.length > local_len - g.local_offset) {
          return InvalidArgument(
              "segment [", g.local_offset, ", +", g.length, ") of local region ",
              g.local_region, " to [", g.remote_offset, ", +", g.length,
              ") of remote region ", g.remote_region, " is outside a region");
        }
        rest.push_back(g);
        continue;
      }
      if (g.remote_offset > m->second.len ||
          g.length > m->second.len - g.remote_offset) {
        return InvalidArgument("segment [", g.remote_offset, ", +", g.length,
                               ") outside remote region ", g.remote_region, " of ",
                               m->second.len, " bytes");
      }
      const uint8_t* src = nullptr;
      bool device = true;
      size_t len = 0;
      PeerMapping* mapping = target->first;
      if (auto st = staged_.find(g.local_region); st != staged_.end()) {
        src = st->second.device;
        len = st->second.len;
        auto own = target->by_copier.find(st->second.copier.get());
        if (own == target->by_copier.end()) {
          return FailedPrecondition("local region ", g.local_region, " on ",
                                    st->second.copier->DeviceName(),
                                    " was staged after the peer was mapped");
        }
        mapping = own->second.get();
      } else if (auto pt = pass_through_.find(g.local_region);
                 pt != pass_through_.end()) {
        src = pt->second.base;
        len = pt->second.len;
        device = !pt->second.kind.is_host();
      } else {
        return InvalidArgument("unknown local region ", g.local_region);
      }
      if (g.local_offset > len || g.length > len - g.local_offset) {
        return InvalidArgument("segment [", g.local_offset, ", +", g.length,
                               ") outside local region ", g.local_region, " of ", len,
                               " bytes");
      }
      Group& group = groups[mapping->copier.get()];
      group.mapping = mapping;
      (device ? group.d2d : group.h2d)
          .push_back({mapping->regions.at(g.remote_region).base + g.remote_offset,
                      src + g.local_offset, g.length});
      bytes += g.length;
      if (busy.empty() || busy.back() != g.local_region) busy.push_back(g.local_region);
    }
    // Checked whole: only now counted busy (DeregisterMemory refuses them).
    for (RegionId r : busy) ++busy_[r];
  }
  const absl::Time start = absl::Now();
  absl::Status copied;
  for (auto& [copier, group] : groups) {
    if (copied.ok() && !group.d2d.empty()) copied = copier->ToPeer(group.d2d);
    if (copied.ok() && !group.h2d.empty()) copied = copier->ToDevice(group.h2d);
  }
  {
    absl::MutexLock l(&mu_);
    for (RegionId r : busy) {
      if (--busy_[r] == 0) busy_.erase(r);
    }
    if (copied.ok()) {
      stats_.bytes_direct += bytes;
      stats_.copy_micros += absl::ToInt64Microseconds(absl::Now() - start);
    }
  }
  if (!copied.ok()) {
    return absl::Status(copied.code(),
                        absl::StrCat("writing the KV into the peer's device memory: ",
                                     copied.message()));
  }
  // The rest (often nothing: then an empty batch, which keeps Poll, Wait and
  // the notification's ordering the inner agent's).
  return PostStaged(peer, rest, std::move(on_done));
}

absl::StatusOr<BatchId> HostStagingAgent::PostRead(PeerId peer,
                                                   absl::Span<const Segment> segments,
                                                   CompletionCallback on_done) {
  {
    absl::MutexLock l(&mu_);
    for (const Segment& g : segments) {
      if (staged_.contains(g.local_region)) {
        return Unimplemented("a read into host-staged region ", g.local_region,
                             ": the host staging moves the KV by writes only");
      }
    }
  }
  return inner_->PostRead(peer, segments, std::move(on_done));
}

absl::StatusOr<RegionId> HostStagingAgent::RegisterMemory(void* base, size_t len,
                                                          MemoryKind kind) {
  TANDEM_ASSIGN_OR_RETURN(RegionId id, inner_->RegisterMemory(base, len, kind));
  absl::MutexLock l(&mu_);
  pass_through_[id] = {static_cast<uint8_t*>(base), len, kind};
  return id;
}

absl::StatusOr<Allocation> HostStagingAgent::AllocateMemory(size_t len) {
  TANDEM_ASSIGN_OR_RETURN(Allocation a, inner_->AllocateMemory(len));
  absl::MutexLock l(&mu_);
  pass_through_[a.region] = {static_cast<uint8_t*>(a.base), len, MemoryKind::Host()};
  return a;
}

absl::Status HostStagingAgent::DeregisterMemory(RegionId region) {
  absl::MutexLock l(&mu_);
  auto it = staged_.find(region);
  if (it == staged_.end()) {
    if (busy_.contains(region)) {
      return FailedPrecondition("region ", region,
                                " is being copied into a peer's device memory");
    }
    TANDEM_RETURN_IF_ERROR(inner_->DeregisterMemory(region));
    pass_through_.erase(region);
    return absl::OkStatus();
  }
  if (busy_.contains(region)) {
    return FailedPrecondition("region ", region,
                              " is being staged (a copy to or from its device runs)");
  }
  TANDEM_RETURN_IF_ERROR(inner_->DeregisterMemory(region));
  for (auto f = in_flight_.begin(); f != in_flight_.end();) {
    auto cur = f++;
    if (cur->first.first == region) in_flight_.erase(cur);
  }
  munmap(it->second.shadow, it->second.mapped);
  if (!it->second.ipc_handle.empty()) --stats_.exported_regions;
  --stats_.staged_regions;
  stats_.shadow_bytes -= it->second.len;
  staged_.erase(it);
  return absl::OkStatus();
}

size_t HostStagingAgent::NumRegisteredRegions() const {
  return inner_->NumRegisteredRegions();
}
uint64_t HostStagingAgent::AgentId() const { return inner_->AgentId(); }
absl::StatusOr<std::string> HostStagingAgent::LocalDescriptor(
    absl::string_view metadata) {
  TANDEM_ASSIGN_OR_RETURN(std::string inner, inner_->LocalDescriptor(metadata));
  std::string ext;
  uint64_t count = 0;
  {
    absl::MutexLock l(&mu_);
    // In region order, so that equal registrations publish equal bytes.
    // All or none: a peer that writes directly skips the shadows of every
    // staged region, so one without a handle would miss its bytes.
    std::vector<std::pair<RegionId, const Staged*>> published;
    for (const auto& [id, st] : staged_) {
      if (st.ipc_handle.empty()) {
        published.clear();
        break;
      }
      published.emplace_back(id, &st);
    }
    std::sort(published.begin(), published.end());
    for (const auto& [id, st] : published) {
      PutLe(&ext, id, 4);
      PutLe(&ext, st->len, 8);
      PutLe(&ext, st->ipc_handle.size(), 4);
      ext += st->ipc_handle;
      ++count;
    }
  }
  if (count == 0) return inner;
  if (ext.size() + 4 > kMaxDescriptorExtensionBytes) {
    absl::MutexLock l(&mu_);
    if (export_status_.ok()) {
      export_status_ = ResourceExhausted(
          "the device IPC handles of ", count, " regions (", ext.size(),
          " bytes) do not fit in a descriptor: not published");
    }
    return inner;
  }
  TANDEM_ASSIGN_OR_RETURN(AgentDescriptor d, ParseDescriptor(inner));
  std::string bytes;
  PutLe(&bytes, count, 4);
  bytes += ext;
  d.extensions.push_back({kExtensionDeviceIpc, std::move(bytes)});
  return SerializeDescriptor(d);
}

absl::StatusOr<PeerId> HostStagingAgent::Connect(absl::string_view peer_descriptor) {
  // A peer that published device memory is written directly where all of it
  // maps here (through the copier of one of this agent's staged regions).
  std::shared_ptr<DirectPeer> direct;
  absl::Status refused;
  absl::StatusOr<AgentDescriptor> d = ParseDescriptor(peer_descriptor);
  const DescriptorExtension* ext =
      d.ok() ? d->FindExtension(kExtensionDeviceIpc) : nullptr;
  if (ext != nullptr && options_.device_ipc) {
    // Every local device's copier, in region order.
    std::vector<std::shared_ptr<StagingCopier>> copiers;
    {
      absl::MutexLock l(&mu_);
      std::vector<std::pair<RegionId, std::shared_ptr<StagingCopier>>> by_region;
      for (const auto& [id, st] : staged_) by_region.emplace_back(id, st.copier);
      std::sort(by_region.begin(), by_region.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      for (auto& [id, c] : by_region) copiers.push_back(std::move(c));
    }
    if (!copiers.empty()) {
      absl::StatusOr<std::shared_ptr<DirectPeer>> mapped =
          MapPeer(*d, ext->bytes, copiers);
      if (mapped.ok()) {
        direct = *std::move(mapped);
      } else {
        refused = absl::Status(
            mapped.status().code(),
            absl::StrCat(
                "the peer's device memory cannot be mapped from ",
                copiers.front()->DeviceName(),
                ", so its KV goes through host memory: ", mapped.status().message()));
      }
    }
  }
  TANDEM_ASSIGN_OR_RETURN(PeerId peer, inner_->Connect(peer_descriptor));
  absl::MutexLock l(&mu_);
  if (!refused.ok()) {
    ++stats_.direct_refused_peers;
    last_direct_refusal_ = refused;
  }
  // Connecting again to a peer already mapped keeps the first mapping.
  if (direct != nullptr && !direct_.contains(peer)) direct_[peer] = std::move(direct);
  return peer;
}

absl::Status HostStagingAgent::Disconnect(PeerId peer) {
  std::shared_ptr<DirectPeer> direct;  // unmapped after the lock, when last
  {
    absl::MutexLock l(&mu_);
    if (auto it = direct_.find(peer); it != direct_.end()) {
      direct = std::move(it->second);
      direct_.erase(it);
    }
  }
  return inner_->Disconnect(peer);
}
size_t HostStagingAgent::NumPeers() const { return inner_->NumPeers(); }
absl::StatusOr<bool> HostStagingAgent::Poll(BatchId batch) {
  return inner_->Poll(batch);
}
absl::Status HostStagingAgent::Wait(BatchId batch, absl::Time deadline) {
  return inner_->Wait(batch, deadline);
}
absl::Status HostStagingAgent::Cancel(BatchId batch) { return inner_->Cancel(batch); }
absl::Status HostStagingAgent::Notify(PeerId peer, absl::string_view request_id,
                                      absl::string_view payload, absl::Time deadline) {
  if (IsDirect(peer)) {
    return inner_->Notify(peer, request_id, absl::StrCat(kDirectMark, payload),
                          deadline);
  }
  return inner_->Notify(peer, request_id, payload, deadline);
}
void HostStagingAgent::SetNotificationCallback(NotificationCallback callback) {
  if (callback == nullptr) return inner_->SetNotificationCallback(nullptr);
  inner_->SetNotificationCallback(
      [callback = std::move(callback)](const Notification& n) { callback(Unmark(n)); });
}
std::vector<Notification> HostStagingAgent::PollNotifications() {
  std::vector<Notification> out = inner_->PollNotifications();
  for (Notification& n : out) n = Unmark(std::move(n));
  return out;
}
std::string HostStagingAgent::Transport(PeerId peer) { return inner_->Transport(peer); }

}  // namespace tandem::kvtransfer
