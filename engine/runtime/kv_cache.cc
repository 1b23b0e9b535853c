#include "engine/runtime/kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "common/status.h"
#include "engine/runtime/shard_dims.h"
#include "parallel/sharding.h"

namespace tandem::engine {
namespace {

constexpr size_t kAlign = 64;

void* AlignedZeroed(size_t bytes) {
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  if (p != nullptr) std::memset(p, 0, rounded);
  return p;
}

bool OnDevice(const KvCacheOptions& o) {
  return o.device != nullptr && o.device->name() != "host";
}

// `bytes` zero-filled bytes from the options' device, allocator or the heap;
// null with `error` set on failure.
void* Allocate(const KvCacheOptions& o, size_t bytes, absl::Status* error) {
  if (OnDevice(o)) {
    // Shareable where asked and possible; else (no such memory, or none left
    // outside the allocator's pool) the device's own: the region is then not
    // published and peers stage through host memory.
    absl::StatusOr<void*> p = absl::UnimplementedError("not shareable");
    if (o.shareable) p = o.device->AllocateShareable(std::max(bytes, kAlign));
    if (absl::IsUnimplemented(p.status()) || absl::IsResourceExhausted(p.status())) {
      p = o.device->Allocate(std::max(bytes, kAlign));
    }
    if (!p.ok()) {
      *error = p.status();
      return nullptr;
    }
    absl::Status s = o.device->Memset(*p, 0, std::max(bytes, kAlign));
    if (!s.ok()) {
      o.device->Free(*p);
      *error = s;
      return nullptr;
    }
    return *p;
  }
  const KvCacheAllocator& a = o.allocator;
  if (!a.allocate) return AlignedZeroed(bytes);
  absl::StatusOr<void*> p = a.allocate(std::max(bytes, kAlign));
  if (!p.ok()) {
    *error = p.status();
    return nullptr;
  }
  if (*p == nullptr || reinterpret_cast<uintptr_t>(*p) % kAlign != 0) {
    *error =
        Internal("kv cache allocator returned address ",
                 reinterpret_cast<uintptr_t>(*p), ", not ", kAlign, "-byte aligned");
    if (*p != nullptr && a.release) a.release(*p);
    return nullptr;
  }
  return *p;
}

bool IsDevice(const kernels::Device* d) { return d != nullptr && d->name() != "host"; }

// n bytes from src.data + soff to dst.data + doff, each side by its device.
absl::Status CopyBytes(const StateRange& dst, size_t doff, const StateRange& src,
                       size_t soff, size_t n, std::vector<uint8_t>* staging,
                       std::set<kernels::Device*>* touched) {
  uint8_t* to = dst.data + doff;
  const uint8_t* from = src.data + soff;
  const bool src_dev = IsDevice(src.device);
  const bool dst_dev = IsDevice(dst.device);
  if (!src_dev && !dst_dev) {
    std::memmove(to, from, n);
    return absl::OkStatus();
  }
  if (!src_dev) {
    touched->insert(dst.device);
    return dst.device->CopyToDevice(to, from, n);
  }
  if (!dst_dev) return src.device->CopyToHost(to, from, n);
  if (src.device == dst.device) {
    touched->insert(dst.device);
    return dst.device->CopyOnDevice(to, from, n);
  }
  // Two devices: through the host (CopyToHost synchronises; the staging buffer
  // is reused only after the device-to-device copy below has run).
  for (kernels::Device* d : *touched) TANDEM_RETURN_IF_ERROR(d->Synchronize());
  touched->clear();
  staging->resize(n);
  TANDEM_RETURN_IF_ERROR(src.device->CopyToHost(staging->data(), from, n));
  TANDEM_RETURN_IF_ERROR(dst.device->CopyToDevice(to, staging->data(), n));
  return dst.device->Synchronize();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(
    const model::ModelConfig& config, const KvCacheOptions& options) {
  if (options.block_size <= 0 || options.num_blocks < 0 || options.num_slots < 0) {
    return InvalidArgument("kv cache: block_size ", options.block_size, ", num_blocks ",
                           options.num_blocks, ", num_slots ", options.num_slots,
                           " (block_size must be > 0, counts >= 0)");
  }
  TANDEM_RETURN_IF_ERROR(parallel::CheckTpSize(ShardDimsOf(config), options.tp_size));
  if (options.tp_rank < 0 || options.tp_rank >= options.tp_size) {
    return InvalidArgument("kv cache: tensor-parallel rank ", options.tp_rank,
                           " not in [0, ", options.tp_size, ")");
  }
  if (OnDevice(options) && (options.allocator.allocate || options.allocator.release)) {
    return InvalidArgument("kv cache: an allocator and device ", options.device->name(),
                           " were both given (device memory comes from the device)");
  }
  auto cache = std::unique_ptr<KvCache>(new KvCache());
  cache->options_ = options;
  cache->layers_ = config.Layers();
  cache->mla_width_ = config.MlaCacheValuesPerToken();
  cache->mla_layer_bytes_ = static_cast<size_t>(options.num_blocks) *
                            options.block_size * cache->mla_width_ * sizeof(uint16_t);
  const auto& la = config.text.linear_attn_config;
  cache->kda_heads_ = la.num_heads / options.tp_size;
  cache->kda_channels_ = cache->kda_heads_ * la.head_dim;
  cache->kda_recurrent_floats_ = cache->kda_heads_ * la.head_dim * la.head_dim;
  cache->kda_conv_floats_ = (la.short_conv_kernel_size - 1) * cache->kda_channels_;
  cache->kda_layer_floats_ = cache->kda_recurrent_floats_ + 3 * cache->kda_conv_floats_;
  for (const model::LayerSpec& spec : cache->layers_) {
    if (spec.attention == model::AttentionKind::kMla) {
      cache->layer_index_.push_back(static_cast<int>(cache->mla_.size()));
      absl::Status error;
      auto* p =
          static_cast<uint16_t*>(Allocate(options, cache->mla_layer_bytes_, &error));
      if (p == nullptr) {
        return ResourceExhausted("kv cache: cannot allocate ", cache->mla_layer_bytes_,
                                 " bytes for an MLA layer: ", error.ToString());
      }
      cache->mla_.push_back(p);
    } else {
      cache->layer_index_.push_back(cache->num_kda_layers_++);
    }
  }
  cache->kda_total_bytes_ = static_cast<size_t>(options.num_slots) *
                            cache->num_kda_layers_ * cache->kda_layer_floats_ *
                            sizeof(float);
  absl::Status error;
  cache->kda_ = static_cast<float*>(Allocate(options, cache->kda_total_bytes_, &error));
  if (cache->kda_ == nullptr) {
    return ResourceExhausted("kv cache: cannot allocate ", cache->kda_total_bytes_,
                             " bytes for the KDA state pool: ", error.ToString());
  }
  return cache;
}

KvCache::~KvCache() {
  const KvCacheAllocator& a = options_.allocator;
  const bool on_device = OnDevice(options_);
  kernels::Device* device = options_.device;
  auto release = [&a, on_device, device](void* p) {
    if (p == nullptr) return;
    if (on_device) {
      device->Free(p);
    } else if (a.release) {
      a.release(p);
    } else {
      std::free(p);
    }
  };
  for (uint16_t* p : mla_) release(p);
  release(kda_);
}

float* KvCache::kda_recurrent(int64_t slot, int kda_index) {
  return kda_ + (slot * num_kda_layers_ + kda_index) * kda_layer_floats_;
}

float* KvCache::kda_conv(int64_t slot, int kda_index, int which) {
  return kda_recurrent(slot, kda_index) + kda_recurrent_floats_ +
         which * kda_conv_floats_;
}

size_t KvCache::total_bytes() const {
  return mla_layer_bytes_ * mla_.size() + kda_total_bytes_;
}

absl::Status KvCache::ResetSlot(int64_t slot) {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  if (OnDevice(options_)) {
    return options_.device->Memset(kda_recurrent(slot, 0), 0, kda_bytes_per_slot());
  }
  std::memset(kda_recurrent(slot, 0), 0, kda_bytes_per_slot());
  return absl::OkStatus();
}

absl::StatusOr<KdaSnapshot> KvCache::SnapshotSlot(int64_t slot) const {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  KdaSnapshot snap;
  const float* begin = kda_ + slot * num_kda_layers_ * kda_layer_floats_;
  if (OnDevice(options_)) {
    snap.values.resize(num_kda_layers_ * kda_layer_floats_);
    TANDEM_RETURN_IF_ERROR(
        options_.device->CopyToHost(snap.values.data(), begin, kda_bytes_per_slot()));
    return snap;
  }
  snap.values.assign(begin, begin + num_kda_layers_ * kda_layer_floats_);
  return snap;
}

absl::Status KvCache::RestoreSlot(int64_t slot, const KdaSnapshot& snapshot) {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  if (static_cast<int64_t>(snapshot.values.size()) !=
      num_kda_layers_ * kda_layer_floats_) {
    return InvalidArgument("kv cache: snapshot has ", snapshot.values.size(),
                           " values, a slot holds ",
                           num_kda_layers_ * kda_layer_floats_);
  }
  if (OnDevice(options_)) {
    return options_.device->CopyToDevice(kda_recurrent(slot, 0), snapshot.values.data(),
                                         kda_bytes_per_slot());
  }
  std::memcpy(kda_recurrent(slot, 0), snapshot.values.data(), kda_bytes_per_slot());
  return absl::OkStatus();
}

absl::Status KvCache::CopySlot(int64_t from, int64_t to) {
  if (from < 0 || from >= options_.num_slots || to < 0 || to >= options_.num_slots) {
    return InvalidArgument("kv cache: slots ", from, " -> ", to, " not in [0, ",
                           options_.num_slots, ")");
  }
  if (from == to) return absl::OkStatus();
  if (OnDevice(options_)) {
    return options_.device->CopyOnDevice(kda_recurrent(to, 0), kda_recurrent(from, 0),
                                         kda_bytes_per_slot());
  }
  std::memcpy(kda_recurrent(to, 0), kda_recurrent(from, 0), kda_bytes_per_slot());
  return absl::OkStatus();
}

absl::Status KvCache::CopyBlockToHost(int64_t block, void* host_dst) const {
  if (block < 0 || block >= options_.num_blocks) {
    return InvalidArgument("kv cache: block ", block, " not in [0, ",
                           options_.num_blocks, ")");
  }
  const size_t per_layer = block_bytes() / std::max<size_t>(1, mla_.size());
  auto* out = static_cast<uint8_t*>(host_dst);
  for (size_t m = 0; m < mla_.size(); ++m) {
    const uint16_t* src = mla_[m] + block * options_.block_size * mla_width_;
    if (OnDevice(options_)) {
      TANDEM_RETURN_IF_ERROR(
          options_.device->CopyToHost(out + m * per_layer, src, per_layer));
    } else {
      std::memcpy(out + m * per_layer, src, per_layer);
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::CopyBlockFromHost(int64_t block, const void* host_src) {
  if (block < 0 || block >= options_.num_blocks) {
    return InvalidArgument("kv cache: block ", block, " not in [0, ",
                           options_.num_blocks, ")");
  }
  const size_t per_layer = block_bytes() / std::max<size_t>(1, mla_.size());
  const auto* in = static_cast<const uint8_t*>(host_src);
  for (size_t m = 0; m < mla_.size(); ++m) {
    uint16_t* dst = mla_[m] + block * options_.block_size * mla_width_;
    if (OnDevice(options_)) {
      TANDEM_RETURN_IF_ERROR(
          options_.device->CopyToDevice(dst, in + m * per_layer, per_layer));
    } else {
      std::memcpy(dst, in + m * per_layer, per_layer);
    }
  }
  // The host bytes may be freed once this returns.
  if (OnDevice(options_)) return options_.device->Synchronize();
  return absl::OkStatus();
}

absl::Status KvCache::CopySlotToHost(int64_t slot, void* host_dst) const {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  const float* src = kda_ + slot * num_kda_layers_ * kda_layer_floats_;
  if (OnDevice(options_)) {
    return options_.device->CopyToHost(host_dst, src, kda_bytes_per_slot());
  }
  std::memcpy(host_dst, src, kda_bytes_per_slot());
  return absl::OkStatus();
}

absl::Status KvCache::CopySlotFromHost(int64_t slot, const void* host_src) {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  if (OnDevice(options_)) {
    TANDEM_RETURN_IF_ERROR(options_.device->CopyToDevice(
        kda_recurrent(slot, 0), host_src, kda_bytes_per_slot()));
    return options_.device->Synchronize();
  }
  std::memcpy(kda_recurrent(slot, 0), host_src, kda_bytes_per_slot());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StateRange>> KvCache::ExportSequence(
    absl::Span<const int32_t> block_table, int64_t num_tokens, int64_t slot) {
  if (slot < 0 || slot >= options_.num_slots) {
    return InvalidArgument("kv cache: slot ", slot, " not in [0, ", options_.num_slots,
                           ")");
  }
  const int64_t bs = options_.block_size;
  const int64_t needed = (num_tokens + bs - 1) / bs;
  if (num_tokens < 0 || static_cast<int64_t>(block_table.size()) < needed) {
    return InvalidArgument("kv cache: ", num_tokens, " tokens need ", needed,
                           " blocks, the table has ", block_table.size());
  }
  for (int64_t b = 0; b < needed; ++b) {
    if (block_table[b] < 0 || block_table[b] >= options_.num_blocks) {
      return InvalidArgument("kv cache: block id ", block_table[b], " not in [0, ",
                             options_.num_blocks, ")");
    }
  }
  const size_t row_bytes = mla_width_ * sizeof(uint16_t);
  kernels::Device* device = OnDevice(options_) ? options_.device : nullptr;
  std::vector<StateRange> out;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const int idx = layer_index_[i];
    if (layers_[i].attention == model::AttentionKind::kMla) {
      for (int64_t b = 0; b < needed; ++b) {
        const int64_t rows = std::min(bs, num_tokens - b * bs);
        StateRange r;
        r.rank = options_.tp_rank;
        r.layer = static_cast<int>(i);
        r.kind = StateKind::kMla;
        r.data =
            reinterpret_cast<uint8_t*>(mla_[idx] + block_table[b] * bs * mla_width_);
        r.bytes = rows * row_bytes;
        r.device = device;
        out.push_back(r);
      }
    } else {
      StateRange r;
      r.rank = options_.tp_rank;
      r.layer = static_cast<int>(i);
      r.kind = StateKind::kKda;
      r.data = reinterpret_cast<uint8_t*>(kda_recurrent(slot, idx));
      r.bytes = kda_bytes_per_layer();
      r.device = device;
      out.push_back(r);
    }
  }
  return out;
}

absl::Status CopyStateRanges(absl::Span<const StateRange> src,
                             absl::Span<const StateRange> dst) {
  using Key = std::tuple<int, int, int>;  // rank, layer, kind
  std::map<Key, std::vector<const StateRange*>> s, d;
  for (const StateRange& r : src) {
    s[{r.rank, r.layer, static_cast<int>(r.kind)}].push_back(&r);
  }
  for (const StateRange& r : dst) {
    d[{r.rank, r.layer, static_cast<int>(r.kind)}].push_back(&r);
  }
  if (s.size() != d.size()) {
    return InvalidArgument("state copy: source has ", s.size(),
                           " layer streams, destination ", d.size());
  }
  for (const auto& [key, sr] : s) {
    auto it = d.find(key);
    if (it == d.end()) {
      return InvalidArgument("state copy: rank ", std::get<0>(key), " layer ",
                             std::get<1>(key), " missing in the destination");
    }
    size_t sb = 0, db = 0;
    for (const StateRange* r : sr) sb += r->bytes;
    for (const StateRange* r : it->second) db += r->bytes;
    if (sb != db) {
      return InvalidArgument("state copy: rank ", std::get<0>(key), " layer ",
                             std::get<1>(key), " has ", sb, " bytes in the source, ",
                             db, " in the destination");
    }
  }
  std::vector<uint8_t> staging;        // device -> other device, via the host
  std::set<kernels::Device*> touched;  // devices that copied: synchronised at the end
  for (const auto& [key, sr] : s) {
    const auto& dr = d[key];
    size_t di = 0, doff = 0;
    for (const StateRange* r : sr) {
      size_t soff = 0;
      while (soff < r->bytes) {
        while (doff == dr[di]->bytes) {
          ++di;
          doff = 0;
        }
        const size_t n = std::min(r->bytes - soff, dr[di]->bytes - doff);
        TANDEM_RETURN_IF_ERROR(
            CopyBytes(*dr[di], doff, *r, soff, n, &staging, &touched));
        soff += n;
        doff += n;
      }
    }
  }
  // Host sources may be freed once this returns: wait for the devices' copies.
  for (kernels::Device* d : touched) TANDEM_RETURN_IF_ERROR(d->Synchronize());
  return absl::OkStatus();
}

absl::Status CopyRangeToHost(const StateRange& r, void* host_dst) {
  if (r.bytes == 0) return absl::OkStatus();
  if (!IsDevice(r.device)) {
    std::memcpy(host_dst, r.data, r.bytes);
    return absl::OkStatus();
  }
  return r.device->CopyToHost(host_dst, r.data, r.bytes);  // synchronises
}

}  // namespace tandem::engine
