// Launchers of the vision-tower kernels (vision.cu): the optional ops Rope2d, Gelu,
// VisionAttention and Merge2x2 of kernels/backend.h. Plain C++ types only (nvcc
// code includes no project headers beyond kernels/cuda/). Device pointers;
// `stream` is the native stream handle. Each returns nullptr on success or the
// launch error; an empty problem launches nothing. Shapes are validated by the
// caller (GpuBackend, kernels/op_checks.h); index contents (positions,
// cu_seqlens) are checked by the kernels, which record bad ones in `error_word`
// (kernels/cuda/device_errors.h).
#ifndef TANDEM_KERNELS_CUDA_VISION_H_
#define TANDEM_KERNELS_CUDA_VISION_H_

#include <cstdint>

namespace tandem::kernels::cuda {

// The widest head the kernels take (K3's tower: 1536 / 12 = 128).
inline constexpr int64_t kVisionMaxHeadDim = 128;

// The widest head Rope2d takes (its frequencies travel as a kernel argument).
inline constexpr int64_t kRope2dMaxHeadDim = 256;

// Rope2d in place over x [tokens, heads * head_dim] (row stride ldx); pos
// [tokens, 2] (row, col) in [0, max_position) (kPositionOutOfRange otherwise:
// that token is left unrotated). head_dim a multiple of 4, <= kRope2dMaxHeadDim.
// `freq` holds head_dim / 4 frequencies f_i (host memory, passed by value), so the
// angles are the CPU backend's: float(pos) * f_i.
const char* LaunchRope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                         int64_t heads, int64_t head_dim, const float* freq,
                         int32_t max_position, int32_t* error_word, void* stream);

// y = gelu(x) over [rows, n] (tanh approximation or erf); y may equal x.
const char* LaunchGelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                       int64_t n, bool tanh_approx, void* stream);

// Which kernel LaunchVisionAttention runs. kAuto: the tensor-core kernel
// (split-BF16 mma.sync, FlashAttention-2) where head_dim % 16 == 0 (K3's 128),
// else the fp32 CUDA-core one; both stay within the same bound of the fp64
// oracle. Tests and the benchmark name one; kTensorCore with another head_dim is
// an error. `bf16_operands` (the "cuda_bf16" backends): the tensor-core kernel
// rounds q, k, v and p to BF16 once (one mma a product, three times the split
// kernel's rate; BF16 bounds); the SIMT kernel is fp32 either way.
enum class VisionAttnCore { kAuto, kSimt, kTensorCore };

// Block-diagonal attention (kernels/backend.h VisionAttnArgs; `out` must not
// overlap q, k or v: other blocks still read them): cu_seqlens is
// device memory; num_tokens and max_seqlen host copies. head_dim <=
// kVisionMaxHeadDim. An image whose token count is negative or above max_seqlen,
// or a table that does not end at num_tokens, records kBadImageTable (its
// rows are not written).
const char* LaunchVisionAttention(const float* q, const float* k, const float* v,
                                  int64_t ld_qkv, float* out, int64_t ld_out,
                                  const int32_t* cu_seqlens, int64_t num_images,
                                  int64_t num_tokens, int64_t max_seqlen, int64_t heads,
                                  int64_t head_dim, float scale, int32_t* error_word,
                                  void* stream,
                                  VisionAttnCore core = VisionAttnCore::kAuto,
                                  bool bf16_operands = false);

// The 2x2 patch merge of one image's [grid_h * grid_w, d] grid into
// [grid_h * grid_w / 4, 4d] (kernels/backend.h Merge2x2).
const char* LaunchMerge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                           int64_t d, float* out, int64_t ldo, void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_VISION_H_
