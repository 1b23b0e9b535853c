#include "kvtransfer/descriptor.h"

#include <xxhash.h>

#include <cstring>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/wire.h"

namespace tandem::kvtransfer {
namespace {

constexpr char kMagic[4] = {'T', 'K', 'V', 'D'};
constexpr size_t kHeaderBytes = 4 + 2 + 1 + 1 + 4 + 8;
constexpr size_t kTrailerBytes = 8;

void PutU8(std::string* out, uint8_t v) { out->push_back(static_cast<char>(v)); }
void PutBytes(std::string* out, absl::string_view s) {
  PutLe(out, s.size(), 4);
  out->append(s.data(), s.size());
}

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid transfer descriptor: ", what));
}

// Bounds-checked little-endian reader over the descriptor body.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  size_t remaining() const { return data_.size() - pos_; }
  bool Le(int bytes, uint64_t* v) {
    absl::string_view rest = data_.substr(pos_);
    if (!GetLe(&rest, bytes, v)) return false;
    pos_ += bytes;
    return true;
  }
  bool Bytes(size_t cap, std::string* out) {
    uint64_t n = 0;
    if (!Le(4, &n) || n > cap || n > remaining()) return false;
    out->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }

 private:
  absl::string_view data_;
  size_t pos_ = 0;
};

}  // namespace

const RegionDescriptor* AgentDescriptor::FindRegion(uint32_t id) const {
  for (const RegionDescriptor& r : regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

const DescriptorExtension* AgentDescriptor::FindExtension(uint32_t tag) const {
  for (const DescriptorExtension& e : extensions) {
    if (e.tag == tag) return &e;
  }
  return nullptr;
}

std::string SerializeDescriptor(const AgentDescriptor& d) {
  std::string out(kMagic, 4);
  PutLe(&out, d.extensions.empty() ? kDescriptorVersion : kDescriptorVersionExtensions,
        2);
  PutU8(&out, static_cast<uint8_t>(d.kind));
  PutU8(&out, 0);
  PutLe(&out, 0, 4);  // total_len, patched below
  PutLe(&out, d.agent_id, 8);
  PutBytes(&out, d.address);
  PutBytes(&out, d.metadata);
  PutLe(&out, d.regions.size(), 4);
  for (const RegionDescriptor& r : d.regions) {
    PutLe(&out, r.id, 4);
    PutLe(&out, r.base, 8);
    PutLe(&out, r.length, 8);
    PutBytes(&out, r.rkey);
  }
  if (!d.extensions.empty()) {
    PutLe(&out, d.extensions.size(), 4);
    for (const DescriptorExtension& e : d.extensions) {
      PutLe(&out, e.tag, 4);
      PutBytes(&out, e.bytes);
    }
  }
  const uint64_t total = out.size() + kTrailerBytes;
  for (int i = 0; i < 4; ++i) out[8 + i] = static_cast<char>((total >> (8 * i)) & 0xff);
  PutLe(&out, XXH3_64bits(out.data(), out.size()), 8);
  return out;
}

absl::StatusOr<AgentDescriptor> ParseDescriptor(absl::string_view bytes) {
  if (bytes.size() < kHeaderBytes + kTrailerBytes) {
    return Bad(absl::StrCat("too short (", bytes.size(), " bytes)"));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) return Bad("bad magic");
  Reader header(bytes.substr(4, kHeaderBytes - 4));
  uint64_t version = 0, kind = 0, reserved = 0, total = 0, agent_id = 0;
  header.Le(2, &version);
  header.Le(1, &kind);
  header.Le(1, &reserved);
  header.Le(4, &total);
  header.Le(8, &agent_id);
  if (version != kDescriptorVersion && version != kDescriptorVersionExtensions) {
    return Bad(absl::StrCat("unsupported version ", version, " (want ",
                            kDescriptorVersion, " or ", kDescriptorVersionExtensions,
                            ")"));
  }
  if (kind != static_cast<uint8_t>(AgentKind::kUcx) &&
      kind != static_cast<uint8_t>(AgentKind::kLoopback) &&
      kind != static_cast<uint8_t>(AgentKind::kLibfabric)) {
    return Bad(absl::StrCat("unknown agent kind ", kind));
  }
  if (reserved != 0) return Bad("reserved byte set");
  if (total != bytes.size()) {
    return Bad(absl::StrCat("length field says ", total, " bytes, got ", bytes.size()));
  }
  const size_t body_end = bytes.size() - kTrailerBytes;
  Reader trailer(bytes.substr(body_end));
  uint64_t checksum = 0;
  trailer.Le(8, &checksum);
  if (checksum != XXH3_64bits(bytes.data(), body_end)) return Bad("checksum mismatch");

  AgentDescriptor d;
  d.kind = static_cast<AgentKind>(kind);
  d.agent_id = agent_id;
  Reader r(bytes.substr(kHeaderBytes, body_end - kHeaderBytes));
  if (!r.Bytes(kMaxDescriptorAddressBytes, &d.address))
    return Bad("truncated or oversized address");
  if (!r.Bytes(kMaxDescriptorMetadataBytes, &d.metadata)) {
    return Bad("truncated or oversized metadata");
  }
  uint64_t num_regions = 0;
  if (!r.Le(4, &num_regions)) return Bad("truncated region count");
  if (num_regions > kMaxDescriptorRegions) {
    return Bad(absl::StrCat("too many regions (", num_regions, ")"));
  }
  // Each region takes at least 24 bytes: reject counts the body cannot hold
  // before reserving memory for them.
  if (num_regions * 24 > r.remaining())
    return Bad("region count exceeds descriptor size");
  d.regions.reserve(num_regions);
  std::unordered_set<uint32_t> ids;
  for (uint64_t i = 0; i < num_regions; ++i) {
    RegionDescriptor region;
    uint64_t id = 0;
    if (!r.Le(4, &id) || !r.Le(8, &region.base) || !r.Le(8, &region.length)) {
      return Bad(absl::StrCat("truncated region ", i));
    }
    region.id = static_cast<uint32_t>(id);
    if (!r.Bytes(kMaxDescriptorRkeyBytes, &region.rkey)) {
      return Bad(absl::StrCat("truncated or oversized remote key of region ", i));
    }
    if (region.length == 0) return Bad(absl::StrCat("region ", region.id, " is empty"));
    if (region.base + region.length < region.base) {
      return Bad(absl::StrCat("region ", region.id, " wraps around the address space"));
    }
    if (!ids.insert(region.id).second)
      return Bad(absl::StrCat("duplicate region id ", region.id));
    d.regions.push_back(std::move(region));
  }
  if (version == kDescriptorVersionExtensions) {
    uint64_t num_extensions = 0;
    if (!r.Le(4, &num_extensions)) return Bad("truncated extension count");
    if (num_extensions == 0 || num_extensions > kMaxDescriptorExtensions) {
      return Bad(absl::StrCat("version ", version, " with ", num_extensions,
                              " extensions (want 1 to ", kMaxDescriptorExtensions,
                              ")"));
    }
    std::unordered_set<uint32_t> tags;
    for (uint64_t i = 0; i < num_extensions; ++i) {
      DescriptorExtension e;
      uint64_t tag = 0;
      if (!r.Le(4, &tag)) return Bad(absl::StrCat("truncated extension ", i));
      e.tag = static_cast<uint32_t>(tag);
      if (!r.Bytes(kMaxDescriptorExtensionBytes, &e.bytes)) {
        return Bad(absl::StrCat("truncated or oversized extension ", i));
      }
      if (!tags.insert(e.tag).second) {
        return Bad(absl::StrCat("duplicate extension tag ", e.tag));
      }
      d.extensions.push_back(std::move(e));
    }
  }
  if (r.remaining() != 0) return Bad(absl::StrCat(r.remaining(), " trailing bytes"));
  return d;
}

}  // namespace tandem::kvtransfer
