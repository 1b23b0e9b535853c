// Image resampling that reproduces Pillow's Image.resize bit for bit
// (Pillow 9.x libImaging/Resample.c, Geometry.c and Convert.c, read and
// re-derived, not copied): BICUBIC (a = -0.5) as a separable convolution,
// horizontal pass then vertical, support 2 * max(1, in/out), 22-bit fixed-point
// weights for 8-bit channels with an 8-bit intermediate, double weights for
// 32-bit integer images; NEAREST as Pillow's affine scale; and the RGBA <->
// premultiplied conversions Pillow wraps an RGBA resize in.
#ifndef TANDEM_ENGINE_MEDIA_PILLOW_RESIZE_H_
#define TANDEM_ENGINE_MEDIA_PILLOW_RESIZE_H_

#include <cstdint>
#include <vector>

namespace tandem::media {

// `in` is width x height x channels (1..4) interleaved. A pass whose size does
// not change is skipped (Pillow's need_horizontal / need_vertical).
std::vector<uint8_t> ResizeBicubic8(const std::vector<uint8_t>& in, int width,
                                    int height, int channels, int out_width,
                                    int out_height);
std::vector<int32_t> ResizeBicubic32(const std::vector<int32_t>& in, int width,
                                     int height, int out_width, int out_height);
std::vector<uint8_t> ResizeNearest8(const std::vector<uint8_t>& in, int width,
                                    int height, int channels, int out_width,
                                    int out_height);

// Pillow's RGBA -> "RGBa" and back (straight <-> premultiplied alpha), in place
// on interleaved 4-channel pixels.
void PremultiplyAlpha(std::vector<uint8_t>* rgba);
void UnpremultiplyAlpha(std::vector<uint8_t>* rgba);

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_PILLOW_RESIZE_H_
