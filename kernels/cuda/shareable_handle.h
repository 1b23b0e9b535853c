// The bytes of a shareable-memory handle (Device::ExportShareable /
// OpenShared, kernels/device.h), shared by the "cuda" device and the "cuda_sim"
// emulator: which host (its boot_id), which process, which allocation and which
// range of it, and a payload of the device's own that maps it (CUDA's
// cudaIpcMemHandle_t and GPU identity; the emulator's memfd).
//
// Layout (native byte order: a handle never leaves its host), 72 bytes + payload:
//   0  magic "TSHM"      4  kind (u16)   6  version (u16)
//   8  boot_id (36 ASCII bytes, /proc/sys/kernel/random/boot_id)
//  44  pid (i32)        48  allocation_bytes (u64)
//  56  offset (u64)     64  length (u64)   72  payload (fixed size per kind)
#ifndef TANDEM_KERNELS_CUDA_SHAREABLE_HANDLE_H_
#define TANDEM_KERNELS_CUDA_SHAREABLE_HANDLE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::kernels::cuda {

// Device::ExportShareable promises at most this many bytes.
inline constexpr size_t kMaxShareableHandleBytes = 256;
inline constexpr size_t kShareableHandleHeaderBytes = 72;
inline constexpr size_t kBootIdBytes = 36;

// Which device exported a handle (a handle of one kind is malformed for another).
enum class ShareableKind : uint16_t {
  kCudaSim = 1,  // payload: SimShareablePayload (sim_device.cc)
  kCuda = 2,     // payload: CudaShareablePayload (cuda_device.cc)
};

struct ShareableHandle {
  ShareableKind kind = ShareableKind::kCudaSim;
  std::string boot_id;            // kBootIdBytes
  int32_t pid = 0;                // the exporting process
  uint64_t allocation_bytes = 0;  // the whole shareable allocation
  uint64_t offset = 0;            // the range exported, inside the allocation
  uint64_t length = 0;
  std::string payload;  // the kind's fixed-size bytes
};

// This host's boot_id (36 characters). FAILED_PRECONDITION where unreadable.
absl::StatusOr<std::string> HostBootId();

// The bytes of `h` (h.boot_id must be kBootIdBytes long).
std::string EncodeShareableHandle(const ShareableHandle& h);

// The handle an exporter gives out: `h`'s kind and range, this host's boot_id,
// this process's pid and `payload`, encoded. FAILED_PRECONDITION naming
// `device` where the boot_id is unreadable.
absl::StatusOr<std::string> SealShareableHandle(ShareableHandle h,
                                                absl::string_view payload,
                                                absl::string_view device);

// Parses bytes that claim to be a handle of `kind` with a payload of
// `payload_bytes`. INVALID_ARGUMENT, naming `device` and what is wrong, for
// anything malformed: wrong size, magic, kind or version; a zero pid; an empty
// range or one outside the allocation.
absl::StatusOr<ShareableHandle> DecodeShareableHandle(absl::string_view bytes,
                                                      ShareableKind kind,
                                                      size_t payload_bytes,
                                                      absl::string_view device);

// OK when this process may open `h`; FAILED_PRECONDITION otherwise: exported on
// another host (boot_id differs) or by this very process (CUDA refuses a
// process's own handles; the emulator refuses them alike).
absl::Status CheckShareableOpenableHere(const ShareableHandle& h,
                                        absl::string_view device);
// The same check against a given host and process.
absl::Status CheckShareableOpenable(const ShareableHandle& h,
                                    absl::string_view host_boot_id, int32_t self_pid,
                                    absl::string_view device);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_SHAREABLE_HANDLE_H_
