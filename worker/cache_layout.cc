#include "worker/cache_layout.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status.h"
#include "kvtransfer/descriptor.h"
#include "nlohmann/json.hpp"

namespace tandem::worker {
namespace {

uint8_t* KdaBase(engine::KvCache& cache) {
  return reinterpret_cast<uint8_t*>(cache.kda_recurrent(0, 0));
}

size_t KdaRecurrentBytes(engine::KvCache& cache) {
  return reinterpret_cast<uint8_t*>(cache.kda_conv(0, 0, 0)) -
         reinterpret_cast<uint8_t*>(cache.kda_recurrent(0, 0));
}

}  // namespace

tandem::v1::KvLayout KvLayoutOf(engine::KvCache& cache) {
  tandem::v1::KvLayout l;
  l.set_block_size(static_cast<int32_t>(cache.block_size()));
  l.set_num_mla_layers(cache.num_mla_layers());
  l.set_num_kda_layers(cache.num_kda_layers());
  l.set_mla_token_bytes(static_cast<int32_t>(cache.mla_width() * 2));
  if (cache.num_kda_layers() > 0) {
    const size_t rec = KdaRecurrentBytes(cache);
    l.set_kda_state_bytes(static_cast<int64_t>(rec));
    l.set_kda_conv_bytes(static_cast<int64_t>(cache.kda_bytes_per_layer() - rec));
  }
  l.set_tp_rank(cache.options().tp_rank);
  l.set_tp_size(cache.options().tp_size);
  l.set_mla_dtype("bf16");
  return l;
}

tandem::v1::StateChecksums MergeRankChecksums(
    absl::Span<const tandem::v1::StateChecksums> ranks) {
  if (ranks.size() == 1) return ranks[0];
  tandem::v1::StateChecksums out;
  for (const tandem::v1::StateChecksums& r : ranks) {
    for (uint64_t c : r.mla_layer()) out.add_mla_layer(c);
  }
  for (const tandem::v1::StateChecksums& r : ranks) {
    for (uint64_t c : r.kda_layer()) out.add_kda_layer(c);
  }
  out.set_total(kvtransfer::TotalChecksum(out));
  return out;
}

engine::KvCacheAllocator AgentAllocations::Allocator() {
  engine::KvCacheAllocator a;
  a.allocate = [this](size_t bytes) { return Allocate(bytes); };
  a.release = [this](void* p) { Release(p); };
  return a;
}

absl::StatusOr<void*> AgentAllocations::Allocate(size_t bytes) {
  absl::StatusOr<kvtransfer::Allocation> got = agent_->AllocateMemory(bytes);
  absl::MutexLock l(&mu_);
  if (got.ok() && reinterpret_cast<uintptr_t>(got->base) % 64 == 0) {
    regions_[got->base] = got->region;
    return got->base;
  }
  if (got.ok()) {  // not aligned enough for the kernels: give it back
    agent_->DeregisterMemory(got->region).IgnoreError();
    got = Internal("agent memory at ", reinterpret_cast<uintptr_t>(got->base),
                   " is not 64-byte aligned");
  }
  TLOG(WARNING, "cache buffer from the heap: the transfer agent cannot allocate it")
      .Kv("bytes", bytes)
      .Kv("status", got.status());
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return ResourceExhausted("cannot allocate ", bytes, " bytes");
  std::memset(p, 0, (bytes + 63) / 64 * 64);
  heap_.insert(p);
  return p;
}

void AgentAllocations::Release(void* p) {
  absl::MutexLock l(&mu_);
  if (auto it = regions_.find(p); it != regions_.end()) {
    if (absl::Status s = agent_->DeregisterMemory(it->second); !s.ok()) {
      TLOG(ERROR, "cannot free a cache buffer held by the transfer agent")
          .Kv("status", s);
    }
    regions_.erase(it);
  } else if (heap_.erase(p) > 0) {
    std::free(p);
  }
}

std::optional<kvtransfer::RegionId> AgentAllocations::RegionOf(const void* base) const {
  absl::MutexLock l(&mu_);
  auto it = regions_.find(base);
  if (it == regions_.end()) return std::nullopt;
  return it->second;
}

size_t AgentAllocations::num_agent_buffers() const {
  absl::MutexLock l(&mu_);
  return regions_.size();
}

size_t AgentAllocations::num_heap_buffers() const {
  absl::MutexLock l(&mu_);
  return heap_.size();
}

absl::StatusOr<kvtransfer::MemoryKind> DeviceMemoryKind(const kernels::Device* d) {
  if (d == nullptr || d->name() == "host" || d->host_addressable()) {
    return kvtransfer::MemoryKind::Host();
  }
  int ordinal = 0;
  absl::string_view name = d->name();
  if (absl::ConsumePrefix(&name, "cuda:") && absl::SimpleAtoi(name, &ordinal) &&
      ordinal >= 0) {
    return kvtransfer::MemoryKind::Cuda(ordinal);
  }
  return Unimplemented("the KV cache is on device ", d->name(),
                       ", which no transfer agent can register (host or cuda:N)");
}

absl::StatusOr<kvtransfer::MemoryKind> CacheMemoryKind(const engine::KvCache& cache) {
  return DeviceMemoryKind(cache.options().device);
}

absl::StatusOr<std::shared_ptr<DeviceStagingCopier>> DeviceStagingCopier::Create(
    kernels::Device* device) {
  if (device == nullptr) return InvalidArgument("no device to stage from");
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Stream> stream,
                          device->CreateStream());
  return std::shared_ptr<DeviceStagingCopier>(
      new DeviceStagingCopier(device, std::move(stream)));
}

namespace {

std::vector<kernels::CopyPiece> Pieces(
    absl::Span<const kvtransfer::StagingCopy> copies) {
  std::vector<kernels::CopyPiece> pieces;
  pieces.reserve(copies.size());
  for (const kvtransfer::StagingCopy& c : copies)
    pieces.push_back({c.dst, c.src, c.bytes});
  return pieces;
}

}  // namespace

absl::Status DeviceStagingCopier::Copy(
    kernels::CopyKind kind, absl::Span<const kvtransfer::StagingCopy> copies) {
  absl::MutexLock l(&mu_);
  TANDEM_RETURN_IF_ERROR(device_->CopyBatchAsync(kind, Pieces(copies), stream_.get()));
  return stream_->Synchronize();
}

absl::Status DeviceStagingCopier::ToHost(
    absl::Span<const kvtransfer::StagingCopy> copies) {
  return Copy(kernels::CopyKind::kDeviceToHost, copies);
}

absl::Status DeviceStagingCopier::ToDevice(
    absl::Span<const kvtransfer::StagingCopy> copies) {
  return Copy(kernels::CopyKind::kHostToDevice, copies);
}

std::string DeviceStagingCopier::DeviceName() const {
  return std::string(device_->name());
}

absl::StatusOr<std::string> DeviceStagingCopier::ExportIpc(const void* device_base,
                                                           size_t len) {
  return device_->ExportShareable(device_base, len);
}

absl::StatusOr<void*> DeviceStagingCopier::OpenIpc(absl::string_view handle) {
  return device_->OpenShared(handle);
}

void DeviceStagingCopier::CloseIpc(void* mapped) { device_->CloseShared(mapped); }

absl::Status DeviceStagingCopier::ToPeer(
    absl::Span<const kvtransfer::StagingCopy> copies) {
  return Copy(kernels::CopyKind::kDeviceToDevice, copies);
}

absl::StatusOr<std::unique_ptr<KvBufferRegistrar>> KvBufferRegistrar::Create(
    kvtransfer::TransferAgent* agent, kernels::Device* device) {
  TANDEM_ASSIGN_OR_RETURN(const kvtransfer::MemoryKind kind, DeviceMemoryKind(device));
  return std::unique_ptr<KvBufferRegistrar>(new KvBufferRegistrar(agent, device, kind));
}

KvBufferRegistrar::KvBufferRegistrar(kvtransfer::TransferAgent* agent,
                                     kernels::Device* device,
                                     kvtransfer::MemoryKind kind)
    : agent_(agent),
      device_(device),
      kind_(kind),
      staging_(dynamic_cast<kvtransfer::HostStagingAgent*>(agent)),
      mode_(staging_ != nullptr ? staging_->options().buffer
                                : kvtransfer::KvBuffer::kDevice) {}

absl::StatusOr<kvtransfer::RegionId> KvBufferRegistrar::Staged(void* base, size_t len) {
  if (copier_ == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(copier_, DeviceStagingCopier::Create(device_));
  }
  return staging_->RegisterStaged(base, len, copier_);
}

absl::StatusOr<kvtransfer::RegionId> KvBufferRegistrar::Register(void* base,
                                                                 size_t len) {
  const bool on_device = device_ != nullptr && device_->name() != "host";
  if (on_device && mode_ == kvtransfer::KvBuffer::kHost) return Staged(base, len);
  absl::StatusOr<kvtransfer::RegionId> direct =
      agent_->RegisterMemory(base, len, kind_);
  if (on_device && mode_ == kvtransfer::KvBuffer::kAuto &&
      absl::IsFailedPrecondition(direct.status())) {
    refused_ = std::string(direct.status().message());
    return Staged(base, len);
  }
  return direct;
}

absl::StatusOr<CacheRegions> RegisterCache(kvtransfer::TransferAgent* agent,
                                           engine::KvCache* cache,
                                           const AgentAllocations* allocations) {
  kernels::Device* device = cache->options().device;
  const bool on_device = device != nullptr && device->name() != "host";
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<KvBufferRegistrar> registrar,
                          KvBufferRegistrar::Create(agent, device));
  auto region = [&](void* base, size_t len) -> absl::StatusOr<kvtransfer::RegionId> {
    if (allocations != nullptr) {
      if (std::optional<kvtransfer::RegionId> r = allocations->RegionOf(base))
        return *r;
    }
    return registrar->Register(base, len);
  };
  CacheRegions r;
  for (int m = 0; m < cache->num_mla_layers(); ++m) {
    TANDEM_ASSIGN_OR_RETURN(kvtransfer::RegionId id,
                            region(cache->mla_layer(m), cache->mla_layer_bytes()));
    r.mla.push_back(id);
  }
  if (cache->num_kda_layers() > 0) {
    TANDEM_ASSIGN_OR_RETURN(r.kda, region(KdaBase(*cache), cache->kda_bytes_per_slot() *
                                                               cache->num_slots()));
  }
  r.staged = registrar->staged();
  if (!registrar->refused().empty()) {
    TLOG(WARNING,
         "the transfer agent cannot register the cache's device memory: the KV "
         "moves through host memory (--kv_buffer=auto; a transport built with "
         "CUDA moves it from device memory)")
        .Kv("device", std::string(device->name()))
        .Kv("agent_said", registrar->refused());
  }
  TLOG(INFO, "KV cache registered with the transfer agent")
      .Kv("device", on_device ? std::string(device->name()) : std::string("host"))
      .Kv("memory", kvtransfer::MemoryKindName(registrar->kind()))
      .Kv("kv_buffer", r.staged ? "staged" : "in_place")
      .Kv("tp_rank", cache->tp_rank())
      .Kv("regions", r.mla.size() + (cache->num_kda_layers() > 0 ? 1 : 0))
      .Kv("bytes", cache->total_bytes());
  return r;
}

kvtransfer::RankLayout CacheRankLayout(engine::KvCache& cache,
                                       const CacheRegions& regions,
                                       absl::Span<const int32_t> block_ids,
                                       int32_t slot) {
  kvtransfer::RankLayout side;
  side.layout = KvLayoutOf(cache);
  for (int m = 0; m < cache.num_mla_layers(); ++m) {
    kvtransfer::MlaPool p;
    p.region = regions.mla[m];
    p.offset = 0;
    p.block_stride = 0;
    p.num_blocks = cache.num_blocks();
    side.mla.push_back(p);
  }
  uint8_t* base = cache.num_kda_layers() > 0 ? KdaBase(cache) : nullptr;
  for (int k = 0; k < cache.num_kda_layers(); ++k) {
    kvtransfer::KdaPool p;
    p.region = regions.kda;
    p.offset = reinterpret_cast<uint8_t*>(cache.kda_recurrent(0, k)) - base;
    p.slot_stride = cache.kda_bytes_per_slot();
    p.conv_offset = KdaRecurrentBytes(cache);
    p.num_slots = cache.num_slots();
    side.kda.push_back(p);
  }
  side.block_ids.assign(block_ids.begin(), block_ids.end());
  side.state_slot = slot;
  return side;
}

absl::StatusOr<std::vector<kvtransfer::ByteRange>> LandedRanges(
    engine::KvCache& cache, const CacheRegions& regions,
    absl::Span<const int32_t> block_ids, int32_t slot, int64_t prompt_tokens,
    int64_t held_tokens) {
  const kvtransfer::RankLayout side = CacheRankLayout(cache, regions, block_ids, slot);
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::TransferPlan plan,
                          kvtransfer::PlanAll(side, side, prompt_tokens, held_tokens));
  std::vector<kvtransfer::ByteRange> ranges;
  ranges.reserve(plan.segments.size());
  for (const kvtransfer::Segment& g : plan.segments) {
    ranges.push_back({g.remote_region, g.remote_offset, g.length});
  }
  return ranges;
}

kvtransfer::RegionBytes CacheRegionBytes(engine::KvCache* cache,
                                         const CacheRegions& regions) {
  const kernels::Device* d = cache->options().device;
  const bool host_bytes = d == nullptr || d->name() == "host" || d->host_addressable();
  return [cache, regions,
          host_bytes](kvtransfer::RegionId id) -> absl::Span<const uint8_t> {
    if (!host_bytes) return {};
    for (size_t m = 0; m < regions.mla.size(); ++m) {
      if (regions.mla[m] == id) {
        return {reinterpret_cast<const uint8_t*>(cache->mla_layer(m)),
                cache->mla_layer_bytes()};
      }
    }
    if (cache->num_kda_layers() > 0 && regions.kda == id) {
      return {KdaBase(*cache), cache->kda_bytes_per_slot() * cache->num_slots()};
    }
    return {};
  };
}

std::string PoolsMetadata(const kvtransfer::RankLayout& side) {
  nlohmann::json j;
  j["mla"] = nlohmann::json::array();
  for (const kvtransfer::MlaPool& p : side.mla) {
    j["mla"].push_back({p.region, p.offset, p.block_stride, p.num_blocks});
  }
  j["kda"] = nlohmann::json::array();
  for (const kvtransfer::KdaPool& p : side.kda) {
    j["kda"].push_back({p.region, p.offset, p.slot_stride, p.conv_offset, p.num_slots});
  }
  return j.dump();
}

absl::StatusOr<kvtransfer::RankLayout> TargetRankLayout(
    const tandem::v1::RankTarget& target) {
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::AgentDescriptor d,
                          kvtransfer::ParseDescriptor(target.transfer_descriptor()));
  kvtransfer::RankLayout side;
  side.layout = target.layout();
  side.block_ids.assign(target.block_ids().begin(), target.block_ids().end());
  side.state_slot = target.state_slot();
  try {
    const nlohmann::json j = nlohmann::json::parse(d.metadata);
    for (const auto& e : j.at("mla")) {
      kvtransfer::MlaPool p;
      p.region = e.at(0).get<kvtransfer::RegionId>();
      p.offset = e.at(1).get<uint64_t>();
      p.block_stride = e.at(2).get<uint64_t>();
      p.num_blocks = e.at(3).get<int64_t>();
      side.mla.push_back(p);
    }
    for (const auto& e : j.at("kda")) {
      kvtransfer::KdaPool p;
      p.region = e.at(0).get<kvtransfer::RegionId>();
      p.offset = e.at(1).get<uint64_t>();
      p.slot_stride = e.at(2).get<uint64_t>();
      p.conv_offset = e.at(3).get<uint64_t>();
      p.num_slots = e.at(4).get<int64_t>();
      side.kda.push_back(p);
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("the target's descriptor metadata is not a pool geometry: ",
                           e.what());
  }
  return side;
}

}  // namespace tandem::worker
