// MXFP4 weights as compressed-tensors "mxfp4-pack-quantized" stores them (OCP MX v1.0):
//   weight_packed U8 [out, in/2]:  byte k of a row holds element 2k in its low
//                                   nibble and element 2k+1 in its high nibble;
//                                   each nibble is an E2M1 code.
//   weight_scale  U8 [out, in/32]: one E8M0 scale per 32 consecutive inputs,
//                                   value 2^(s-127); 0xFF is NaN.
// E2M1 codes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes 8..15 are their negatives.
#ifndef TANDEM_ENGINE_MODEL_MXFP4_H_
#define TANDEM_ENGINE_MODEL_MXFP4_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace tandem::model {

inline constexpr int kMxfp4GroupSize = 32;
inline constexpr float kE2M1Max = 6.0f;

// Value of a 4-bit E2M1 code (only the low 4 bits are used).
float DecodeE2M1(uint8_t code);
// Value of an E8M0 scale byte: 2^(s-127); NaN for 0xFF.
float DecodeE8M0(uint8_t scale);

// Dequantises one row of `in` elements (`in` a multiple of 32): `packed` holds
// in/2 bytes, `scales` in/32 bytes, `out` in floats.
void DequantizeMxfp4Row(const uint8_t* packed, const uint8_t* scales, size_t in,
                        float* out);

// Dequantises a whole [rows, in] matrix; errors on size mismatches.
absl::Status DequantizeMxfp4(absl::Span<const uint8_t> packed,
                             absl::Span<const uint8_t> scales, size_t rows, size_t in,
                             std::vector<float>* out);

// Nearest E2M1 code to `x` (already divided by the group scale), ties to the
// code with an even mantissa bit (round-half-even on the E2M1 grid), saturating
// at ±6. NaN maps to +0 (callers never pass NaN). -0 and values rounding to 0 give
// code 0 (+0).
uint8_t EncodeE2M1(float x);

// Quantises a [rows, in] float matrix (`in` a multiple of 32). Per group of 32:
// amax = max |x|; scale exponent e = floor(log2(amax)) - 2 (so amax/2^e lies in
// [4, 8) and the largest values land on 4 or 6), clamped to the E8M0 range
// [-127, 127]; an all-zero group gets scale byte 0 (2^-127) and zero codes. Each
// element is divided by 2^e and rounded with EncodeE2M1.
absl::Status QuantizeMxfp4(absl::Span<const float> weights, size_t rows, size_t in,
                           std::vector<uint8_t>* packed, std::vector<uint8_t>* scales);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_MXFP4_H_
