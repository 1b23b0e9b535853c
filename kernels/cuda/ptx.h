// PTX instructions used by the kernels, each behind one small device function.
// Under nvcc the function is the inline PTX; under cuda_sim it is a warp
// collective that implements the PTX ISA's definition for the 32 lanes, fragment
// layout included, so kernels written against the real layout compute the same
// result on the emulator (and wrong ones when they get the layout wrong).
//
//   MmaBf16M16N8K16(d, a, b)   d[4] += A(16x16, row) * B(16x8, col), fp32 accumulate
//     (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32). With g = lane / 4 and
//     t = lane % 4, each 32-bit register holds two BF16, the lower index in the low
//     half:
//       a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
//       a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//       b[0] = B[2t..2t+1][g]     b[1] = B[2t+8..2t+9][g]
//       d[0..1] = D[g][2t..2t+1]  d[2..3] = D[g+8][2t..2t+1]
//   LdMatrixX4(r, smem_row)     ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes
//     8i..8i+7 give the 8 row addresses (16 bytes each) of matrix i; lane l gets
//     r[i] = matrix i's row l / 4, columns 2(l % 4)..2(l % 4)+1.
//   CpAsync16(smem, gmem)       cp.async.cg.shared.global 16 bytes; CpAsyncCommit()
//     closes a group, CpAsyncWait<N>() waits until at most N groups are pending.
//     The emulator lands each copy either at once or only when it is waited for
//     (a seeded draw per copy; at seed 0 always at the wait), so a kernel that
//     reads before waiting, or issues a copy into a buffer others still read,
//     computes wrong results under some seeds.
#ifndef TANDEM_KERNELS_CUDA_PTX_H_
#define TANDEM_KERNELS_CUDA_PTX_H_

#include <cmath>
#include <cstdint>

#include "kernels/cuda/vendor.h"

namespace tandem::gpu {

#if defined(TANDEM_GPU_NVCC)

__device__ __forceinline__ void MmaBf16M16N8K16(float d[4], const uint32_t a[4],
                                                const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  // "memory": shared stores before it must not be moved past it (the register
  // operands alone do not tell the compiler it reads shared memory).
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  // "memory": loads of the copied data must not be hoisted above the wait.
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#else  // cuda_sim

void MmaBf16M16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]);
void LdMatrixX4(uint32_t r[4], const void* smem_row);
void CpAsync16(void* smem, const void* gmem);
void CpAsyncCommit();
void CpAsyncWaitGroups(int n);
template <int N>
inline void CpAsyncWait() {
  CpAsyncWaitGroups(N);
}

#endif

// ---- Operand helpers of the mma kernels (MLA, vision) --------------------------

// Words per shared-memory row of `width` BF16 operands (padded to a multiple of
// 16 values), = 4 mod 8 so that the fragment loads (8 rows x 4 words) hit 32
// banks.
__host__ __device__ __forceinline__ int64_t MmaStride(int64_t width) {
  int64_t w = (width + 15) / 16 * 8;
  while (w % 8 != 4) ++w;
  return w;
}

// Split-BF16 of two fp32 values: returns hi (two BF16, x0 in the low half) and
// stores lo = bf16(x - hi), so hi + lo carries ~16 of fp32's 24 bits and
// a.b ~ hi.hi + hi.lo + lo.hi (three mma) is exact to ~2^-16 relative.
__device__ __forceinline__ uint32_t SplitBf16x2(float x0, float x1, uint32_t* lo) {
  const uint16_t h0 = F32ToBf16(x0), h1 = F32ToBf16(x1);
  *lo = PackBf16x2(F32ToBf16(x0 - Bf16ToF32(h0)), F32ToBf16(x1 - Bf16ToF32(h1)));
  return PackBf16x2(h0, h1);
}

// One operand pair into BF16: split (hi returned, lo stored) or rounded once
// (lo = 0).
template <bool kSplit>
__device__ __forceinline__ uint32_t ToBf16x2(float x0, float x1, uint32_t* lo) {
  if constexpr (kSplit) {
    return SplitBf16x2(x0, x1, lo);
  } else {
    *lo = 0;
    return PackBf16x2(F32ToBf16(x0), F32ToBf16(x1));
  }
}

// ---- FlashAttention-2 tile steps on mma.sync m16n8k16 (MLA's expanded kernel,
// the vision attention) -----------------------------------------------------------
// A warp owns 16 query rows; this lane (g = lane / 4, tq = lane % 4) holds rows
// g (hr 0) and g + 8 (hr 1), and of a 32-key tile the scores sc[nt][2 hr + e] of
// key 8 nt + 2 tq + e (the C layout of four n8 tiles).

// The online-softmax step: masked scores must be -inf already. Turns sc into
// the tile's unnormalised probabilities, updates the running max m and sum l,
// and rescales the output accumulators acc[0 .. kTiles).
template <int kTiles>
__device__ __forceinline__ void FlashSoftmaxTile(float sc[4][4], float m[2], float l[2],
                                                 float (*acc)[4]) {
  float alpha[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      mx = fmaxf(mx, fmaxf(sc[nt][2 * hr], sc[nt][2 * hr + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float m_new = fmaxf(m[hr], mx);
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& v = sc[nt][2 * hr + e];
        v = (m_new == -INFINITY || v == -INFINITY) ? 0.0f : expf(v - m_new);
        sum += v;
      }
    }
    alpha[hr] = m_new == -INFINITY ? 1.0f : expf(m[hr] - m_new);  // 0 on a first tile
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    l[hr] = l[hr] * alpha[hr] + sum;
    m[hr] = m_new;
  }
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    acc[j][0] *= alpha[0];
    acc[j][1] *= alpha[0];
    acc[j][2] *= alpha[1];
    acc[j][3] *= alpha[1];
  }
}

// O += P V over the tile's 32 keys: the probabilities of n8 tiles 2 kk and
// 2 kk + 1 are the A fragment of k-step kk (as BF16, split when kSplit: three
// mma a product); V's B fragment packs two keys' values of column 8 j + g from
// shared rows of 16-bit values, `row16` values a key (vl16: the lo parts, used
// only when kSplit). Output tiles j < vt (<= kTiles).
template <bool kSplit, int kTiles>
__device__ __forceinline__ void FlashPvTile(const float sc[4][4], const uint16_t* vh16,
                                            const uint16_t* vl16, int64_t row16, int vt,
                                            int g, int tq, float (*acc)[4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t ph[4], pl[4];
    ph[0] = ToBf16x2<kSplit>(sc[2 * kk][0], sc[2 * kk][1], &pl[0]);
    ph[1] = ToBf16x2<kSplit>(sc[2 * kk][2], sc[2 * kk][3], &pl[1]);
    ph[2] = ToBf16x2<kSplit>(sc[2 * kk + 1][0], sc[2 * kk + 1][1], &pl[2]);
    ph[3] = ToBf16x2<kSplit>(sc[2 * kk + 1][2], sc[2 * kk + 1][3], &pl[3]);
    const int64_t r0 = (16 * kk + 2 * tq) * row16;  // key rows 2 tq, +1, +8, +9
    const int64_t r1 = r0 + row16, r8 = r0 + 8 * row16, r9 = r8 + row16;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (j >= vt) break;
      const int64_t c = 8 * j + g;
      const uint32_t bh[2] = {PackBf16x2(vh16[r0 + c], vh16[r1 + c]),
                              PackBf16x2(vh16[r8 + c], vh16[r9 + c])};
      MmaBf16M16N8K16(acc[j], ph, bh);
      if constexpr (kSplit) {
        const uint32_t bl[2] = {PackBf16x2(vl16[r0 + c], vl16[r1 + c]),
                                PackBf16x2(vl16[r8 + c], vl16[r9 + c])};
        MmaBf16M16N8K16(acc[j], ph, bl);
        MmaBf16M16N8K16(acc[j], pl, bh);
      }
    }
  }
}

}  // namespace tandem::gpu

#endif  // TANDEM_KERNELS_CUDA_PTX_H_
