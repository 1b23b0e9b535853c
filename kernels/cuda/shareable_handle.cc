#include "kernels/cuda/shareable_handle.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace tandem::kernels::cuda {
namespace {

constexpr char kMagic[4] = {'T', 'S', 'H', 'M'};
constexpr uint16_t kVersion = 1;

constexpr size_t kKindAt = 4;
constexpr size_t kVersionAt = 6;
constexpr size_t kBootIdAt = 8;
constexpr size_t kPidAt = 44;
constexpr size_t kAllocationAt = 48;
constexpr size_t kOffsetAt = 56;
constexpr size_t kLengthAt = 64;
static_assert(kLengthAt + 8 == kShareableHandleHeaderBytes);
static_assert(kBootIdAt + kBootIdBytes == kPidAt);

template <typename T>
void Put(std::string& out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof v);
}
template <typename T>
T Get(absl::string_view in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

const char* KindName(uint16_t kind) {
  switch (kind) {
    case static_cast<uint16_t>(ShareableKind::kCudaSim):
      return "cuda_sim";
    case static_cast<uint16_t>(ShareableKind::kCuda):
      return "cuda";
  }
  return "unknown";
}

}  // namespace

absl::StatusOr<std::string> HostBootId() {
  constexpr const char* kPath = "/proc/sys/kernel/random/boot_id";
  FILE* f = std::fopen(kPath, "r");
  if (f == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read ", kPath, ": ", std::strerror(errno)));
  }
  char buf[64] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const std::string id(absl::StripAsciiWhitespace(absl::string_view(buf, n)));
  if (id.size() != kBootIdBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(kPath, " holds \"", absl::CHexEscape(id), "\", not a boot id"));
  }
  return id;
}

absl::StatusOr<std::string> SealShareableHandle(ShareableHandle h,
                                                absl::string_view payload,
                                                absl::string_view device) {
  absl::StatusOr<std::string> boot_id = HostBootId();
  if (!boot_id.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(device, ": ", boot_id.status().message()));
  }
  h.boot_id = *boot_id;
  h.pid = static_cast<int32_t>(getpid());
  h.payload = std::string(payload);
  return EncodeShareableHandle(h);
}

std::string EncodeShareableHandle(const ShareableHandle& h) {
  std::string out(kShareableHandleHeaderBytes + h.payload.size(), '\0');
  std::memcpy(out.data(), kMagic, sizeof kMagic);
  Put<uint16_t>(out, kKindAt, static_cast<uint16_t>(h.kind));
  Put<uint16_t>(out, kVersionAt, kVersion);
  std::memcpy(out.data() + kBootIdAt, h.boot_id.data(),
              std::min(h.boot_id.size(), kBootIdBytes));
  Put<int32_t>(out, kPidAt, h.pid);
  Put<uint64_t>(out, kAllocationAt, h.allocation_bytes);
  Put<uint64_t>(out, kOffsetAt, h.offset);
  Put<uint64_t>(out, kLengthAt, h.length);
  if (!h.payload.empty()) {
    std::memcpy(out.data() + kShareableHandleHeaderBytes, h.payload.data(),
                h.payload.size());
  }
  return out;
}

absl::StatusOr<ShareableHandle> DecodeShareableHandle(absl::string_view bytes,
                                                      ShareableKind kind,
                                                      size_t payload_bytes,
                                                      absl::string_view device) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(device, ": not a shareable memory handle: ", why));
  };
  const size_t want = kShareableHandleHeaderBytes + payload_bytes;
  if (bytes.size() < kShareableHandleHeaderBytes ||
      std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    if (bytes.size() >= sizeof kMagic &&
        std::memcmp(bytes.data(), kMagic, sizeof kMagic) == 0) {
      return bad(absl::StrCat(bytes.size(), " bytes, want ", want));
    }
    return bad(absl::StrCat("no magic (", bytes.size(), " bytes)"));
  }
  const uint16_t k = Get<uint16_t>(bytes, kKindAt);
  if (k != static_cast<uint16_t>(kind)) {
    return bad(absl::StrCat("exported by a ", KindName(k), " device (kind ", k,
                            "), this is a ", KindName(static_cast<uint16_t>(kind)),
                            " device"));
  }
  const uint16_t version = Get<uint16_t>(bytes, kVersionAt);
  if (version != kVersion) {
    return bad(absl::StrCat("version ", version, ", this build reads ", kVersion));
  }
  if (bytes.size() != want) {
    return bad(absl::StrCat(bytes.size(), " bytes, want ", want));
  }
  ShareableHandle h;
  h.kind = kind;
  h.boot_id = std::string(bytes.substr(kBootIdAt, kBootIdBytes));
  h.pid = Get<int32_t>(bytes, kPidAt);
  h.allocation_bytes = Get<uint64_t>(bytes, kAllocationAt);
  h.offset = Get<uint64_t>(bytes, kOffsetAt);
  h.length = Get<uint64_t>(bytes, kLengthAt);
  h.payload = std::string(bytes.substr(kShareableHandleHeaderBytes));
  if (h.pid <= 0) return bad(absl::StrCat("pid ", h.pid));
  if (h.length == 0) return bad("an empty range");
  if (h.offset > h.allocation_bytes || h.length > h.allocation_bytes - h.offset) {
    return bad(absl::StrCat("range [", h.offset, ", +", h.length,
                            ") outside its allocation of ", h.allocation_bytes,
                            " bytes"));
  }
  return h;
}

absl::Status CheckShareableOpenable(const ShareableHandle& h,
                                    absl::string_view host_boot_id, int32_t self_pid,
                                    absl::string_view device) {
  if (h.boot_id != host_boot_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        device, ": the shareable memory handle comes from another host (boot_id \"",
        absl::CHexEscape(h.boot_id), "\", this host's is ", host_boot_id,
        "): device memory is shared only between processes of one host"));
  }
  if (h.pid == self_pid) {
    return absl::FailedPreconditionError(absl::StrCat(
        device, ": the shareable memory handle was exported by this process (pid ",
        self_pid,
        "): CUDA IPC opens only other processes' memory; use the pointer itself"));
  }
  return absl::OkStatus();
}

absl::Status CheckShareableOpenableHere(const ShareableHandle& h,
                                        absl::string_view device) {
  absl::StatusOr<std::string> boot_id = HostBootId();
  if (!boot_id.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(device, ": ", boot_id.status().message()));
  }
  return CheckShareableOpenable(h, *boot_id, static_cast<int32_t>(getpid()), device);
}

}  // namespace tandem::kernels::cuda
