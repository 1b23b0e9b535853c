// The serialised descriptor an agent publishes so peers can reach its memory.
//
// Binary, little-endian, versioned (docs/kvtransfer.md, "Descriptor format"):
//   "TKVD" u16 version u8 kind u8 reserved u32 total_len u64 agent_id
//   u32 address_len, address bytes        (UCX worker address / loopback id)
//   u32 metadata_len, metadata bytes      (opaque to kvtransfer)
//   u32 num_regions, per region: u32 id u64 base u64 length u32 rkey_len rkey
//   version 2 only: u32 num_extensions (1..16), per extension: u32 tag,
//     u32 len, bytes (what a decorating agent adds, e.g. the host staging's
//     device IPC handles; agents ignore tags they do not know)
//   u64 XXH3-64 of everything before it
// A descriptor without extensions is written as version 1, as before.
// ParseDescriptor never trusts the input: every length is checked against the
// remaining bytes and against fixed caps, so corrupt or hostile bytes give
// INVALID_ARGUMENT, never a crash (fuzzed by descriptor_fuzz_test).
#ifndef TANDEM_KVTRANSFER_DESCRIPTOR_H_
#define TANDEM_KVTRANSFER_DESCRIPTOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::kvtransfer {

enum class AgentKind : uint8_t { kUcx = 1, kLoopback = 2, kLibfabric = 3 };

inline constexpr uint16_t kDescriptorVersion = 1;
// Version 2: version 1 followed by extensions.
inline constexpr uint16_t kDescriptorVersionExtensions = 2;
inline constexpr size_t kMaxDescriptorExtensions = 16;
inline constexpr size_t kMaxDescriptorExtensionBytes = 1 << 20;
inline constexpr size_t kMaxDescriptorAddressBytes = 64 * 1024;
inline constexpr size_t kMaxDescriptorMetadataBytes = 1 << 20;
inline constexpr size_t kMaxDescriptorRegions = 1 << 16;
inline constexpr size_t kMaxDescriptorRkeyBytes = 64 * 1024;

struct RegionDescriptor {
  uint32_t id = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  std::string rkey;  // packed remote key (empty for loopback)
};

// Extension tags.
inline constexpr uint32_t kExtensionDeviceIpc = 1;  // HostStagingAgent

struct DescriptorExtension {
  uint32_t tag = 0;
  std::string bytes;
  friend bool operator==(const DescriptorExtension&,
                         const DescriptorExtension&) = default;
};

struct AgentDescriptor {
  AgentKind kind = AgentKind::kUcx;
  uint64_t agent_id = 0;
  std::string address;
  std::string metadata;
  std::vector<RegionDescriptor> regions;
  std::vector<DescriptorExtension> extensions;  // distinct tags

  // The region with `id`, or nullptr.
  const RegionDescriptor* FindRegion(uint32_t id) const;
  // The extension with `tag`, or nullptr.
  const DescriptorExtension* FindExtension(uint32_t tag) const;
};

std::string SerializeDescriptor(const AgentDescriptor& descriptor);
absl::StatusOr<AgentDescriptor> ParseDescriptor(absl::string_view bytes);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_DESCRIPTOR_H_
