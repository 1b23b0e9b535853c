// Single-threaded GEMM kernels per ISA: Y[m, n] (+)= X[m, k] @ W[n, k]^T.
// cpu_backend splits the work across threads and picks the ISA. Each function is
// compiled in its own translation unit with that ISA's -m flags (kernels/cpu/BUILD)
// and must only be called when HardwareIsa() supports it.
#ifndef TANDEM_KERNELS_CPU_GEMM_KERNELS_H_
#define TANDEM_KERNELS_CPU_GEMM_KERNELS_H_

#include <cstdint>

namespace tandem::kernels::internal {

// AVX512_BF16 (vdpbf16ps): X already rounded to BF16 (xb [m, ldxb]).
void GemmBf16Avx512Bf16(const uint16_t* xb, int64_t ldxb, const uint16_t* w,
                        int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
                        int64_t k, bool accumulate);
// Converts X rows [m, k] fp32 to BF16 (round to nearest even) into xb [m, ldxb].
void ConvertRowsToBf16Avx512Bf16(const float* x, int64_t ldx, uint16_t* xb,
                                 int64_t ldxb, int64_t m, int64_t k);

// fp32 FMA on BF16 weights widened in registers (exact: BF16 -> fp32 is exact).
void GemmBf16Avx512(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                    float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                    bool accumulate);
void GemmF32Avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                   int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);

void GemmBf16Avx2(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
void GemmF32Avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);

// Portable fp32 loops (kGeneric).
void GemmBf16Generic(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                     float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                     bool accumulate);
void GemmF32Generic(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                    int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);

// Cache blocking shared by the kernels: K in blocks of kGemmKc, N in blocks of
// kGemmNc, micro-tiles of up to 4 x 4 dot products.
inline constexpr int64_t kGemmKc = 2048;
inline constexpr int64_t kGemmNc = 64;

}  // namespace tandem::kernels::internal

#endif  // TANDEM_KERNELS_CPU_GEMM_KERNELS_H_
