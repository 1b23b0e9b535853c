// Error codes kernels record in the backend's device error word (first error
// wins: atomicCAS(word, 0, code)). GpuBackend::Synchronize() turns them into
// InvalidArgument statuses naming the kind. Plain C++: included by .cu sources.
#ifndef TANDEM_KERNELS_CUDA_DEVICE_ERRORS_H_
#define TANDEM_KERNELS_CUDA_DEVICE_ERRORS_H_

#include <cstdint>

namespace tandem::kernels::cuda {

enum DeviceError : int32_t {
  kDeviceOk = 0,
  kTokenIdOutOfRange = 1,
  kSlotOutOfRange = 2,
  kBlockIdOutOfRange = 3,
  kExpertIdOutOfRange = 4,
  kBadSequenceLength = 5,
  kBadSegmentTable = 6,
  kPositionOutOfRange = 7,
  kBadImageTable = 8,
};

inline const char* DeviceErrorName(int32_t code) {
  switch (code) {
    case kTokenIdOutOfRange:
      return "token id out of range";
    case kSlotOutOfRange:
      return "cache slot out of range";
    case kBlockIdOutOfRange:
      return "block id out of range";
    case kExpertIdOutOfRange:
      return "expert id out of range";
    case kBadSequenceLength:
      return "query longer than its sequence";
    case kBadSegmentTable:
      return "byte segment table does not run contiguously over total_bytes";
    case kPositionOutOfRange:
      return "rotary position out of range";
    case kBadImageTable:
      return "image token table (cu_seqlens) not ascending from 0 to num_tokens within "
             "max_seqlen";
    default:
      return "unknown device error";
  }
}

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_DEVICE_ERRORS_H_
