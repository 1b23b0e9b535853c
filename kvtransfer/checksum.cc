#include "kvtransfer/checksum.h"

#include <xxhash.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer {
namespace {

struct StateDeleter {
  void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
};

void PutLe(uint64_t v, std::string* buf) {
  for (int i = 0; i < 8; ++i) buf->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The layer's stream as spans of its regions (bounds checked; contents unread).
absl::StatusOr<ByteStream> LayerStream(const RankLayout& side, LayerRef layer,
                                       int64_t num_tokens, const RegionBytes& regions) {
  auto ranges = LayerRanges(side, layer, num_tokens);
  if (!ranges.ok()) return ranges.status();
  ByteStream stream;
  for (const ByteRange& r : *ranges) {
    absl::Span<const uint8_t> bytes = regions(r.region);
    if (bytes.empty() || r.offset > bytes.size() ||
        r.length > bytes.size() - r.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("checksum range [", r.offset, ", +", r.length,
                       ") outside region ", r.region, " of ", bytes.size(), " bytes"));
    }
    if (r.length > 0) stream.push_back(bytes.subspan(r.offset, r.length));
  }
  return stream;
}

// Chunk hashes of a stream in host memory (libxxhash).
absl::StatusOr<std::vector<uint64_t>> HostChunkHashes(const ByteStream& stream) {
  std::unique_ptr<XXH64_state_t, StateDeleter> state(XXH64_createState());
  if (state == nullptr) return absl::InternalError("XXH64_createState failed");
  std::vector<uint64_t> hashes;
  int64_t filled = 0;
  XXH64_reset(state.get(), 0);
  for (absl::Span<const uint8_t> piece : stream) {
    size_t pos = 0;
    while (pos < piece.size()) {
      const size_t n = std::min<size_t>(
          piece.size() - pos, static_cast<size_t>(kChecksumChunkBytes - filled));
      XXH64_update(state.get(), piece.data() + pos, n);
      pos += n;
      filled += static_cast<int64_t>(n);
      if (filled == kChecksumChunkBytes) {
        hashes.push_back(XXH64_digest(state.get()));
        XXH64_reset(state.get(), 0);
        filled = 0;
      }
    }
  }
  if (filled > 0) hashes.push_back(XXH64_digest(state.get()));
  return hashes;
}

std::vector<LayerRef> AllLayers(const RankLayout& side) {
  std::vector<LayerRef> layers;
  for (int l = 0; l < side.layout.num_mla_layers(); ++l)
    layers.push_back({LayerKind::kMla, l});
  for (int l = 0; l < side.layout.num_kda_layers(); ++l)
    layers.push_back({LayerKind::kKda, l});
  return layers;
}

}  // namespace

uint64_t LayerFromChunkHashes(absl::Span<const uint64_t> chunk_hashes) {
  std::string buf;
  buf.reserve(chunk_hashes.size() * 8);
  for (uint64_t h : chunk_hashes) PutLe(h, &buf);
  return XXH64(buf.data(), buf.size(), 0);
}

absl::StatusOr<uint64_t> LayerChecksum(const RankLayout& side, LayerRef layer,
                                       int64_t num_tokens, const RegionBytes& regions) {
  auto stream = LayerStream(side, layer, num_tokens, regions);
  if (!stream.ok()) return stream.status();
  auto hashes = HostChunkHashes(*stream);
  if (!hashes.ok()) return hashes.status();
  return LayerFromChunkHashes(*hashes);
}

uint64_t TotalChecksum(const tandem::v1::StateChecksums& sums) {
  std::string buf;
  for (uint64_t v : sums.mla_layer()) PutLe(v, &buf);
  for (uint64_t v : sums.kda_layer()) PutLe(v, &buf);
  return XXH3_64bits(buf.data(), buf.size());
}

absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(
    const RankLayout& side, int64_t num_tokens, const RegionBytes& regions) {
  return ComputeChecksums(side, num_tokens, ChecksumMemory{regions, true, nullptr});
}

absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(
    const RankLayout& side, int64_t num_tokens, const ChecksumMemory& memory) {
  if (!memory.host_addressable && memory.hasher == nullptr) {
    return absl::FailedPreconditionError(
        "state checksums: the state is in device memory the host cannot read and no "
        "device chunk hasher was given (worker/device_checksum.h)");
  }
  if (!memory.regions) {
    return absl::InvalidArgumentError("state checksums: no region bytes");
  }
  const std::vector<LayerRef> layers = AllLayers(side);
  std::vector<ByteStream> streams;
  streams.reserve(layers.size());
  for (const LayerRef& layer : layers) {
    auto stream = LayerStream(side, layer, num_tokens, memory.regions);
    if (!stream.ok()) return stream.status();
    streams.push_back(std::move(*stream));
  }
  std::vector<std::vector<uint64_t>> hashes;
  if (memory.hasher != nullptr) {
    auto h = memory.hasher->HashChunks(streams, kChecksumChunkBytes);
    if (!h.ok()) return h.status();
    if (h->size() != streams.size()) {
      return absl::InternalError(absl::StrCat("chunk hasher returned ", h->size(),
                                              " streams for ", streams.size()));
    }
    hashes = std::move(*h);
  } else {
    for (const ByteStream& stream : streams) {
      auto h = HostChunkHashes(stream);
      if (!h.ok()) return h.status();
      hashes.push_back(std::move(*h));
    }
  }
  tandem::v1::StateChecksums sums;
  for (size_t i = 0; i < layers.size(); ++i) {
    int64_t bytes = 0;
    for (absl::Span<const uint8_t> piece : streams[i]) bytes += piece.size();
    const size_t want = (bytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
    if (hashes[i].size() != want) {
      return absl::InternalError(absl::StrCat("chunk hasher returned ",
                                              hashes[i].size(), " chunk hashes for ",
                                              bytes, " bytes, expected ", want));
    }
    const uint64_t c = LayerFromChunkHashes(hashes[i]);
    if (layers[i].kind == LayerKind::kMla) {
      sums.add_mla_layer(c);
    } else {
      sums.add_kda_layer(c);
    }
  }
  sums.set_total(TotalChecksum(sums));
  return sums;
}

absl::Status Verify(const tandem::v1::StateChecksums& expected,
                    const tandem::v1::StateChecksums& actual) {
  if (expected.mla_layer_size() != actual.mla_layer_size() ||
      expected.kda_layer_size() != actual.kda_layer_size()) {
    return absl::DataLossError(absl::StrCat(
        "state checksums cover different layers: expected ", expected.mla_layer_size(),
        " MLA + ", expected.kda_layer_size(), " KDA, got ", actual.mla_layer_size(),
        " MLA + ", actual.kda_layer_size(), " KDA"));
  }
  for (int l = 0; l < expected.mla_layer_size(); ++l) {
    if (expected.mla_layer(l) != actual.mla_layer(l)) {
      return absl::DataLossError(absl::StrCat(
          "state checksum mismatch in MLA layer ", l, ": expected ",
          absl::Hex(expected.mla_layer(l)), ", got ", absl::Hex(actual.mla_layer(l))));
    }
  }
  for (int l = 0; l < expected.kda_layer_size(); ++l) {
    if (expected.kda_layer(l) != actual.kda_layer(l)) {
      return absl::DataLossError(absl::StrCat(
          "state checksum mismatch in KDA layer ", l, ": expected ",
          absl::Hex(expected.kda_layer(l)), ", got ", absl::Hex(actual.kda_layer(l))));
    }
  }
  if (expected.total() != actual.total()) {
    return absl::DataLossError(absl::StrCat("state checksum total mismatch: expected ",
                                            absl::Hex(expected.total()), ", got ",
                                            absl::Hex(actual.total())));
  }
  return absl::OkStatus();
}

}  // namespace tandem::kvtransfer
