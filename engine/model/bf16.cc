#include "engine/model/bf16.h"

#include <cmath>

namespace tandem::model {

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = (bits >> 15) & 1u;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t mant = bits & 0x3ffu;
  float value;
  if (exp == 0) {
    value = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    value = mant == 0 ? INFINITY : NAN;
  } else {
    value = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -value : value;
}

uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in half: value / 2^-24, rounded to even.
    float a;
    std::memcpy(&a, &abs, sizeof(a));
    float scaled = a * 16777216.0f;    // exact (power of two)
    float r = std::nearbyint(scaled);  // default rounding mode: ties to even
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: rebias exponent (127 → 15) and round the 23-bit mantissa to 10 bits.
  uint32_t v = abs - (112u << 23);
  uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return sign | static_cast<uint16_t>(v >> 13);
}

}  // namespace tandem::model
