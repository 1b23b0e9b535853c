#include "worker/device_checksum.h"

#include <algorithm>
#include <utility>

#include "common/status.h"

namespace tandem::worker {
namespace {

// Grows `buf` on `device` to at least `bytes` (1 MiB steps). `grew` is set when
// it allocated: a device allocates in its compute stream's order, and the
// hasher's own stream may use the memory only once that has run.
absl::Status Reserve(kernels::Device* device, size_t bytes, kernels::DeviceBuffer* buf,
                     bool* grew) {
  if (buf->data() != nullptr && buf->bytes() >= bytes) return absl::OkStatus();
  constexpr size_t kStep = size_t{1} << 20;
  const size_t want = (std::max<size_t>(bytes, 1) + kStep - 1) / kStep * kStep;
  buf->Reset();
  TANDEM_ASSIGN_OR_RETURN(*buf, kernels::DeviceBuffer::Allocate(device, want));
  *grew = true;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<uint64_t>>> BackendChunkHasher::HashChunks(
    absl::Span<const kvtransfer::ByteStream> streams, int64_t chunk_bytes) {
  if (backend_ == nullptr) return FailedPrecondition("chunk hasher: no backend");
  if (!backend_->Supports(kernels::Op::kChunkHashes)) {
    return FailedPrecondition("chunk hasher: backend ", backend_->name(),
                              " does not support ChunkHashes");
  }
  if (chunk_bytes <= 0 || chunk_bytes > kernels::kMaxHashChunkBytes) {
    return InvalidArgument("chunk hasher: chunk_bytes ", chunk_bytes);
  }
  // Host tables of all streams back to back, and where each stream's go.
  std::vector<kernels::ByteSegment> table;
  struct Stream {
    size_t first_segment = 0, num_segments = 0, first_hash = 0, num_hashes = 0;
    int64_t bytes = 0;
  };
  std::vector<Stream> where(streams.size());
  size_t num_hashes = 0;
  kernels::Device& dev = backend_->device();
  for (size_t i = 0; i < streams.size(); ++i) {
    Stream& w = where[i];
    w.first_segment = table.size();
    for (absl::Span<const uint8_t> piece : streams[i]) {
      if (piece.empty()) continue;
      // Where the device can answer cheaply (cuda_sim, host): its memory only.
      if (dev.host_addressable() && !dev.Owns(piece.data(), piece.size())) {
        return FailedPrecondition("chunk hasher: a piece of stream ", i, " (",
                                  piece.size(), " bytes) is not memory of device ",
                                  dev.name());
      }
      table.push_back({piece.data(), w.bytes, static_cast<int64_t>(piece.size())});
      w.bytes += static_cast<int64_t>(piece.size());
    }
    w.num_segments = table.size() - w.first_segment;
    w.first_hash = num_hashes;
    w.num_hashes = static_cast<size_t>((w.bytes + chunk_bytes - 1) / chunk_bytes);
    num_hashes += w.num_hashes;
  }
  std::vector<std::vector<uint64_t>> out(streams.size());
  if (num_hashes == 0) return out;

  absl::MutexLock lock(&mu_);
  // The calling thread (an engine loop, a sender) may have another device
  // current: a kernel launched into a stream of a device that is not current
  // fails on a GPU.
  TANDEM_RETURN_IF_ERROR(dev.MakeCurrent());
  if (stream_ == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(stream_, dev.CreateStream());
  }
  kernels::Stream* s = stream_.get();
  const size_t table_bytes = table.size() * sizeof(kernels::ByteSegment);
  bool grew = false;
  TANDEM_RETURN_IF_ERROR(Reserve(&dev, table_bytes, &tables_, &grew));
  TANDEM_RETURN_IF_ERROR(Reserve(&dev, num_hashes * sizeof(uint64_t), &hashes_, &grew));
  // Stream-ordered allocations (cudaMallocFromPoolAsync on the compute stream):
  // complete before `s` touches them (rare: only when a buffer grows).
  if (grew) TANDEM_RETURN_IF_ERROR(dev.compute_stream().Synchronize());
  TANDEM_RETURN_IF_ERROR(
      dev.CopyToDevice(tables_.data(), table.data(), table_bytes, s));
  const auto* dtable = tables_.as<kernels::ByteSegment>();
  auto* dhashes = hashes_.as<uint64_t>();
  for (const Stream& w : where) {
    if (w.bytes == 0) continue;
    kernels::ChunkHashArgs a;
    a.segments = dtable + w.first_segment;
    a.num_segments = static_cast<int64_t>(w.num_segments);
    a.total_bytes = w.bytes;
    a.chunk_bytes = chunk_bytes;
    a.hashes = dhashes + w.first_hash;
    a.stream = s;
    if (absl::Status st = backend_->ChunkHashes(a); !st.ok()) {
      // The table upload may still be queued: `table` must outlive it.
      (void)s->Synchronize();
      return Annotate(st, "state checksums");
    }
  }
  std::vector<uint64_t> all(num_hashes);
  // Ordered after the launches on `s`; returns with the data here.
  TANDEM_RETURN_IF_ERROR(
      dev.CopyToHost(all.data(), dhashes, num_hashes * sizeof(uint64_t), s));
  for (size_t i = 0; i < where.size(); ++i) {
    out[i].assign(all.begin() + where[i].first_hash,
                  all.begin() + where[i].first_hash + where[i].num_hashes);
  }
  return out;
}

kvtransfer::ChecksumMemory CacheChecksumMemory(engine::KvCache* cache,
                                               const CacheRegions& regions,
                                               kvtransfer::ChunkHasher* hasher,
                                               const kernels::Device& device) {
  kvtransfer::ChecksumMemory m;
  m.host_addressable = device.host_addressable();
  m.hasher = hasher;
  m.regions = [cache, regions](kvtransfer::RegionId id) -> absl::Span<const uint8_t> {
    for (size_t l = 0; l < regions.mla.size(); ++l) {
      if (regions.mla[l] == id) {
        return {reinterpret_cast<const uint8_t*>(cache->mla_layer(l)),
                cache->mla_layer_bytes()};
      }
    }
    if (cache->num_kda_layers() > 0 && regions.kda == id) {
      return {reinterpret_cast<const uint8_t*>(cache->kda_recurrent(0, 0)),
              cache->kda_bytes_per_slot() * cache->num_slots()};
    }
    return {};
  };
  return m;
}

std::vector<kernels::Backend*> DeviceChecksumBackends(engine::Engine& engine) {
  std::vector<kernels::Backend*> out;
  engine::TpExecutor& ex = engine.executor();
  for (int r = 0; r < ex.tp_size(); ++r) {
    kernels::Backend& b = ex.backend(r);
    if (b.device().name() == "host") return {};
    out.push_back(&b);
  }
  return out;
}

}  // namespace tandem::worker
