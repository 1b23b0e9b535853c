#include "engine/media/pillow_resize.h"

#include <algorithm>
#include <cmath>

namespace tandem::media {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;

double BicubicFilter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// Per output index: the first input index, the tap count, and `ksize`
// normalised weights.
struct Coefficients {
  int ksize = 0;
  std::vector<int> first;
  std::vector<int> count;
  std::vector<double> weights;  // [out_size * ksize]
};

Coefficients Precompute(int in_size, int out_size) {
  constexpr double kSupport = 2.0;  // BICUBIC
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = kSupport * filterscale;
  Coefficients c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size) * c.ksize, 0.0);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double* k = &c.weights[static_cast<size_t>(xx) * c.ksize];
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double w = BicubicFilter((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    for (int x = 0; x < xmax; ++x) {
      if (ww != 0.0) k[x] /= ww;
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

std::vector<int32_t> FixedPoint(const Coefficients& c) {
  std::vector<int32_t> kk(c.weights.size());
  for (size_t i = 0; i < kk.size(); ++i) {
    const double w = c.weights[i];
    kk[i] = w < 0 ? static_cast<int32_t>(-0.5 + w * (1 << kPrecisionBits))
                  : static_cast<int32_t>(0.5 + w * (1 << kPrecisionBits));
  }
  return kk;
}

inline uint8_t Clip8(int32_t v) {
  v >>= kPrecisionBits;  // arithmetic shift, as Pillow's lookup index
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

std::vector<uint8_t> Horizontal8(const std::vector<uint8_t>& in, int width, int height,
                                 int channels, int out_width) {
  const Coefficients c = Precompute(width, out_width);
  const std::vector<int32_t> kk = FixedPoint(c);
  std::vector<uint8_t> out(static_cast<size_t>(out_width) * height * channels);
  for (int y = 0; y < height; ++y) {
    const uint8_t* row = &in[static_cast<size_t>(y) * width * channels];
    uint8_t* orow = &out[static_cast<size_t>(y) * out_width * channels];
    for (int xx = 0; xx < out_width; ++xx) {
      const int32_t* k = &kk[static_cast<size_t>(xx) * c.ksize];
      const int xmin = c.first[xx];
      for (int ch = 0; ch < channels; ++ch) {
        int32_t ss = 1 << (kPrecisionBits - 1);
        for (int x = 0; x < c.count[xx]; ++x) {
          ss += row[(x + xmin) * channels + ch] * k[x];
        }
        orow[xx * channels + ch] = Clip8(ss);
      }
    }
  }
  return out;
}

std::vector<uint8_t> Vertical8(const std::vector<uint8_t>& in, int width, int height,
                               int channels, int out_height) {
  const Coefficients c = Precompute(height, out_height);
  const std::vector<int32_t> kk = FixedPoint(c);
  const size_t stride = static_cast<size_t>(width) * channels;
  std::vector<uint8_t> out(stride * out_height);
  for (int yy = 0; yy < out_height; ++yy) {
    const int32_t* k = &kk[static_cast<size_t>(yy) * c.ksize];
    const int ymin = c.first[yy];
    for (size_t i = 0; i < stride; ++i) {
      int32_t ss = 1 << (kPrecisionBits - 1);
      for (int y = 0; y < c.count[yy]; ++y) {
        ss += in[(y + ymin) * stride + i] * k[y];
      }
      out[yy * stride + i] = Clip8(ss);
    }
  }
  return out;
}

inline int32_t RoundUp(double f) {
  return static_cast<int32_t>(f >= 0.0 ? f + 0.5f : f - 0.5f);
}

inline uint8_t MulDiv255(unsigned a, unsigned b) {
  const unsigned t = a * b + 128;
  return static_cast<uint8_t>(((t >> 8) + t) >> 8);
}

}  // namespace

std::vector<uint8_t> ResizeBicubic8(const std::vector<uint8_t>& in, int width,
                                    int height, int channels, int out_width,
                                    int out_height) {
  std::vector<uint8_t> cur = in;
  if (out_width != width) cur = Horizontal8(cur, width, height, channels, out_width);
  if (out_height != height) {
    cur = Vertical8(cur, out_width, height, channels, out_height);
  }
  return cur;
}

std::vector<int32_t> ResizeBicubic32(const std::vector<int32_t>& in, int width,
                                     int height, int out_width, int out_height) {
  std::vector<int32_t> cur = in;
  if (out_width != width) {
    const Coefficients c = Precompute(width, out_width);
    std::vector<int32_t> out(static_cast<size_t>(out_width) * height);
    for (int y = 0; y < height; ++y) {
      for (int xx = 0; xx < out_width; ++xx) {
        const double* k = &c.weights[static_cast<size_t>(xx) * c.ksize];
        double ss = 0.0;
        for (int x = 0; x < c.count[xx]; ++x) {
          ss += cur[static_cast<size_t>(y) * width + x + c.first[xx]] * k[x];
        }
        out[static_cast<size_t>(y) * out_width + xx] = RoundUp(ss);
      }
    }
    cur = std::move(out);
  }
  if (out_height != height) {
    const Coefficients c = Precompute(height, out_height);
    std::vector<int32_t> out(static_cast<size_t>(out_width) * out_height);
    for (int yy = 0; yy < out_height; ++yy) {
      const double* k = &c.weights[static_cast<size_t>(yy) * c.ksize];
      for (int x = 0; x < out_width; ++x) {
        double ss = 0.0;
        for (int y = 0; y < c.count[yy]; ++y) {
          ss += cur[static_cast<size_t>(y + c.first[yy]) * out_width + x] * k[y];
        }
        out[static_cast<size_t>(yy) * out_width + x] = RoundUp(ss);
      }
    }
    cur = std::move(out);
  }
  return cur;
}

std::vector<uint8_t> ResizeNearest8(const std::vector<uint8_t>& in, int width,
                                    int height, int channels, int out_width,
                                    int out_height) {
  // Pillow: an affine transform with a = in/out, sampled at an accumulated
  // position that starts half a step in, truncated.
  const double ax = static_cast<double>(width) / out_width;
  const double ay = static_cast<double>(height) / out_height;
  std::vector<int> xin(out_width);
  double xo = ax * 0.5;
  for (int x = 0; x < out_width; ++x) {
    xin[x] = std::min(static_cast<int>(xo), width - 1);
    xo += ax;
  }
  std::vector<uint8_t> out(static_cast<size_t>(out_width) * out_height * channels);
  double yo = ay * 0.5;
  for (int y = 0; y < out_height; ++y) {
    const int yi = std::min(static_cast<int>(yo), height - 1);
    yo += ay;
    for (int x = 0; x < out_width; ++x) {
      for (int ch = 0; ch < channels; ++ch) {
        out[(static_cast<size_t>(y) * out_width + x) * channels + ch] =
            in[(static_cast<size_t>(yi) * width + xin[x]) * channels + ch];
      }
    }
  }
  return out;
}

void PremultiplyAlpha(std::vector<uint8_t>* rgba) {
  for (size_t i = 0; i + 3 < rgba->size(); i += 4) {
    uint8_t* p = &(*rgba)[i];
    p[0] = MulDiv255(p[0], p[3]);
    p[1] = MulDiv255(p[1], p[3]);
    p[2] = MulDiv255(p[2], p[3]);
  }
}

void UnpremultiplyAlpha(std::vector<uint8_t>* rgba) {
  for (size_t i = 0; i + 3 < rgba->size(); i += 4) {
    uint8_t* p = &(*rgba)[i];
    const unsigned alpha = p[3];
    if (alpha == 0 || alpha == 255) continue;
    for (int c = 0; c < 3; ++c) {
      const unsigned v = (255u * p[c]) / alpha;
      p[c] = static_cast<uint8_t>(v > 255 ? 255 : v);
    }
  }
}

}  // namespace tandem::media
