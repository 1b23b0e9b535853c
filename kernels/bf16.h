// BF16 <-> fp32 conversion on bit patterns (BF16 = the high 16 bits of an fp32).
#ifndef TANDEM_KERNELS_BF16_H_
#define TANDEM_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

namespace tandem::kernels {

inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_BF16_H_
