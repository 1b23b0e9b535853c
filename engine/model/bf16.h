// bfloat16 and IEEE half conversions (bit patterns held in uint16_t).
#ifndef TANDEM_ENGINE_MODEL_BF16_H_
#define TANDEM_ENGINE_MODEL_BF16_H_

#include <cstdint>
#include <cstring>

namespace tandem::model {

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest, ties to even; NaN stays NaN (quiet), infinities stay.
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force a quiet payload
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

// IEEE 754 binary16 → float (exact; subnormals, infinities and NaN handled).
float HalfToFloat(uint16_t bits);
// float → binary16, round to nearest even, overflow to infinity.
uint16_t FloatToHalf(float f);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_BF16_H_
