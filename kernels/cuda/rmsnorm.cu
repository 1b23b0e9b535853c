// One block per row; each thread strides over the row, then a shared-memory tree
// reduction of the sum of squares. fp32 throughout.
#include <cuda_runtime.h>

#include "kernels/cuda/rmsnorm_cuda.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ w,
                              float* __restrict__ y, int64_t n, float eps) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float* yr = y + row * n;
  __shared__ float partial[kThreads];
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = rsqrtf(partial[0] / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

std::string Err(cudaError_t e) { return e == cudaSuccess ? "" : cudaGetErrorString(e); }

}  // namespace

std::string RmsNormDevice(const float* x, const float* w, float* y, int64_t rows,
                          int64_t n, float eps, void* stream) {
  if (rows == 0) return "";
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0,
                  static_cast<cudaStream_t>(stream)>>>(x, w, y, n, eps);
  return Err(cudaGetLastError());
}

std::string RmsNormHost(const float* x, const float* w, float* y, int64_t rows,
                        int64_t n, float eps) {
  float *dx = nullptr, *dw = nullptr, *dy = nullptr;
  const size_t xb = sizeof(float) * rows * n, wb = sizeof(float) * n;
  std::string err;
  if ((err = Err(cudaMalloc(&dx, xb))).empty() &&
      (err = Err(cudaMalloc(&dw, wb))).empty() &&
      (err = Err(cudaMalloc(&dy, xb))).empty() &&
      (err = Err(cudaMemcpy(dx, x, xb, cudaMemcpyHostToDevice))).empty() &&
      (err = Err(cudaMemcpy(dw, w, wb, cudaMemcpyHostToDevice))).empty() &&
      (err = RmsNormDevice(dx, dw, dy, rows, n, eps, nullptr)).empty() &&
      (err = Err(cudaDeviceSynchronize())).empty()) {
    err = Err(cudaMemcpy(y, dy, xb, cudaMemcpyDeviceToHost));
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
  return err;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace tandem::kernels::cuda
