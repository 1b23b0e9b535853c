#include "kernels/cuda/vendor.h"
// (vendor.h first)
#include "kernels/cuda/blas_kernels.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;

// Block (r, by) converts columns [by * 1024, by * 1024 + 1024) of row r; the four
// elements of a thread are kThreads apart, so every load and store instruction of
// a warp touches consecutive addresses.
__global__ void F32ToBf16RowsKernel(const float* __restrict__ x, int64_t ldx,
                                    uint16_t* __restrict__ out, int64_t k) {
  const int64_t r = blockIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * kThreads * kPerThread;
  const float* src = x + r * ldx;
  uint16_t* dst = out + r * k;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t c = base + i * kThreads + threadIdx.x;
    if (c < k) dst[c] = tandem::gpu::F32ToBf16(src[c]);
  }
}

__global__ void F32ToBf16SplitRowsKernel(const float* __restrict__ x, int64_t ldx,
                                         uint16_t* __restrict__ out, int64_t m,
                                         int64_t k) {
  const int64_t r = blockIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * kThreads * kPerThread;
  const float* src = x + r * ldx;
  uint16_t* hi = out + r * k;
  uint16_t* lo = out + (m + r) * k;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t c = base + i * kThreads + threadIdx.x;
    if (c < k) {
      const float v = src[c];
      const uint16_t h = tandem::gpu::F32ToBf16(v);
      const float rest = v - tandem::gpu::Bf16ToF32(h);
      hi[c] = h;
      lo[c] = isfinite(v) ? tandem::gpu::F32ToBf16(rest) : uint16_t{0};
    }
  }
}

__global__ void AddRowPairsKernel(const float* __restrict__ pair, int64_t m, int64_t n,
                                  float* __restrict__ y, int64_t ldy, bool accumulate) {
  const int64_t r = blockIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * kThreads * kPerThread;
  const float* a = pair + r * n;
  const float* b = pair + (m + r) * n;
  float* out = y + r * ldy;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t c = base + i * kThreads + threadIdx.x;
    if (c < n) {
      const float v = a[c] + b[c];
      out[c] = accumulate ? out[c] + v : v;
    }
  }
}

// Rows x column blocks of kThreads * kPerThread.
const char* RowGrid(int64_t m, int64_t k, dim3* grid) {
  const int64_t per_block = kThreads * kPerThread;
  const int64_t col_blocks = (k + per_block - 1) / per_block;
  if (col_blocks > 65535) return "rows too long";
  if (m > 2147483647) return "too many rows";
  *grid = dim3(static_cast<unsigned>(m), static_cast<unsigned>(col_blocks));
  return nullptr;
}

}  // namespace

const char* LaunchF32ToBf16SplitRows(const float* x, int64_t ldx, uint16_t* out,
                                     int64_t m, int64_t k, void* stream) {
  if (m <= 0 || k <= 0) return nullptr;
  dim3 grid;
  if (const char* e = RowGrid(m, k, &grid)) return e;
  TANDEM_LAUNCH(F32ToBf16SplitRowsKernel, grid, dim3(kThreads), 0, stream, x, ldx, out,
                m, k);
  return tandem::gpu::LaunchError();
}

const char* LaunchAddRowPairs(const float* pair, int64_t m, int64_t n, float* y,
                              int64_t ldy, bool accumulate, void* stream) {
  if (m <= 0 || n <= 0) return nullptr;
  dim3 grid;
  if (const char* e = RowGrid(m, n, &grid)) return e;
  TANDEM_LAUNCH(AddRowPairsKernel, grid, dim3(kThreads), 0, stream, pair, m, n, y, ldy,
                accumulate);
  return tandem::gpu::LaunchError();
}

const char* LaunchF32ToBf16Rows(const float* x, int64_t ldx, uint16_t* out, int64_t m,
                                int64_t k, void* stream) {
  if (m <= 0 || k <= 0) return nullptr;
  const int64_t per_block = kThreads * kPerThread;
  const int64_t col_blocks = (k + per_block - 1) / per_block;
  if (col_blocks > 65535) return "LaunchF32ToBf16Rows: rows too long";
  const dim3 grid(static_cast<unsigned>(m), static_cast<unsigned>(col_blocks));
  TANDEM_LAUNCH(F32ToBf16RowsKernel, grid, dim3(kThreads), 0, stream, x, ldx, out, k);
  return tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
