#include "engine/model/mxfp4.h"

#include <cmath>

#include "common/status.h"

namespace tandem::model {
namespace {

constexpr float kE2M1Magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

}  // namespace

float DecodeE2M1(uint8_t code) {
  float m = kE2M1Magnitudes[code & 0x7];
  return (code & 0x8) ? -m : m;
}

float DecodeE8M0(uint8_t scale) {
  if (scale == 0xff) return NAN;
  return std::ldexp(1.0f, static_cast<int>(scale) - 127);
}

void DequantizeMxfp4Row(const uint8_t* packed, const uint8_t* scales, size_t in,
                        float* out) {
  for (size_t g = 0; g < in / kMxfp4GroupSize; ++g) {
    const float s = DecodeE8M0(scales[g]);
    const uint8_t* p = packed + g * (kMxfp4GroupSize / 2);
    float* o = out + g * kMxfp4GroupSize;
    for (int k = 0; k < kMxfp4GroupSize / 2; ++k) {
      o[2 * k] = DecodeE2M1(p[k] & 0x0f) * s;
      o[2 * k + 1] = DecodeE2M1(p[k] >> 4) * s;
    }
  }
}

absl::Status DequantizeMxfp4(absl::Span<const uint8_t> packed,
                             absl::Span<const uint8_t> scales, size_t rows, size_t in,
                             std::vector<float>* out) {
  if (in % kMxfp4GroupSize != 0) {
    return InvalidArgument("MXFP4 input dim ", in, " is not a multiple of ",
                           kMxfp4GroupSize);
  }
  if (packed.size() != rows * in / 2) {
    return InvalidArgument("MXFP4 packed has ", packed.size(), " bytes, [", rows, ",",
                           in, "] needs ", rows * in / 2);
  }
  if (scales.size() != rows * in / kMxfp4GroupSize) {
    return InvalidArgument("MXFP4 scales has ", scales.size(), " bytes, [", rows, ",",
                           in, "] needs ", rows * in / kMxfp4GroupSize);
  }
  out->resize(rows * in);
  for (size_t r = 0; r < rows; ++r) {
    DequantizeMxfp4Row(packed.data() + r * in / 2,
                       scales.data() + r * in / kMxfp4GroupSize, in,
                       out->data() + r * in);
  }
  return absl::OkStatus();
}

uint8_t EncodeE2M1(float x) {
  if (std::isnan(x)) return 0;
  const uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  const float a = std::fabs(x);
  // Midpoints between neighbouring magnitudes; at an exact midpoint pick the code
  // with the even index (its mantissa bit is 0): round-half-even on the grid.
  uint8_t code = 7;
  for (uint8_t c = 0; c < 7; ++c) {
    const float mid = 0.5f * (kE2M1Magnitudes[c] + kE2M1Magnitudes[c + 1]);
    if (a < mid) {
      code = c;
      break;
    }
    if (a == mid) {
      code = (c % 2 == 0) ? c : static_cast<uint8_t>(c + 1);
      break;
    }
  }
  if (code == 0) return 0;  // no negative zero
  return sign | code;
}

absl::Status QuantizeMxfp4(absl::Span<const float> weights, size_t rows, size_t in,
                           std::vector<uint8_t>* packed, std::vector<uint8_t>* scales) {
  if (in % kMxfp4GroupSize != 0) {
    return InvalidArgument("MXFP4 input dim ", in, " is not a multiple of ",
                           kMxfp4GroupSize);
  }
  if (weights.size() != rows * in) {
    return InvalidArgument("MXFP4 quantise: ", weights.size(), " values for [", rows,
                           ",", in, "]");
  }
  packed->assign(rows * in / 2, 0);
  scales->assign(rows * in / kMxfp4GroupSize, 0);
  const size_t groups = rows * in / kMxfp4GroupSize;
  for (size_t g = 0; g < groups; ++g) {
    const float* x = weights.data() + g * kMxfp4GroupSize;
    float amax = 0.0f;
    for (int i = 0; i < kMxfp4GroupSize; ++i) {
      if (!std::isfinite(x[i])) {
        return InvalidArgument("MXFP4 quantise: non-finite value at element ",
                               g * kMxfp4GroupSize + i);
      }
      amax = std::fmax(amax, std::fabs(x[i]));
    }
    if (amax == 0.0f) continue;    // scale byte 0, codes 0
    int e = std::ilogb(amax) - 2;  // floor(log2(amax)) - 2, exact for subnormals too
    if (e < -127) e = -127;
    if (e > 127) e = 127;
    (*scales)[g] = static_cast<uint8_t>(e + 127);
    uint8_t* p = packed->data() + g * kMxfp4GroupSize / 2;
    // x * 2^-e is exact except where it underflows, and those values encode to 0.
    const float inv = std::ldexp(1.0f, -e);
    for (int k = 0; k < kMxfp4GroupSize / 2; ++k) {
      const uint8_t lo = EncodeE2M1(x[2 * k] * inv);
      const uint8_t hi = EncodeE2M1(x[2 * k + 1] * inv);
      p[k] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::model
