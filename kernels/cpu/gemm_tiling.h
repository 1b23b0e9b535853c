// The blocking loop shared by every GEMM kernel TU: a header-only template so
// that each TU instantiates it with its own ISA flags. Micro(mr, nr, ...) computes
// an mr x nr tile of dot products over kb elements and stores (or adds) them.
#ifndef TANDEM_KERNELS_CPU_GEMM_TILING_H_
#define TANDEM_KERNELS_CPU_GEMM_TILING_H_

#include <cstdint>

#include "kernels/cpu/gemm_kernels.h"

namespace tandem::kernels::internal {
// Everything here has internal linkage on purpose: each kernel TU instantiates
// these templates with its own ISA flags and its own anonymous-namespace Micro
// kernels, which GCC mangles identically across TUs; as ordinary (weak) template
// instantiations they were merged by the linker, so one ISA's GEMM silently ran
// another ISA's micro-kernels (the exact AVX-512 backend ran AVX2 code, and an
// AVX2-only machine could have been handed AVX-512 code).
namespace {

// MicroTable: MicroTable::Get(mr, nr) returns a function
//   void(const XT* x, int64_t ldx, const WT* w, int64_t ldw, float* y, int64_t ldy,
//        int64_t kb, bool add)
template <typename XT, typename WT, typename MicroTable>
void BlockedGemm(const XT* x, int64_t ldx, const WT* w, int64_t ldw, float* y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  // Plain loops and ternaries rather than std::fill / std::min: this template is
  // instantiated in TUs with different -m flags, and a shared out-of-line std
  // instantiation could carry wider-ISA code into a narrower caller.
  if (k == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) y[i * ldy + j] = 0.0f;
      }
    }
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kGemmKc) {
    const int64_t kb = k - k0 < kGemmKc ? k - k0 : kGemmKc;
    const bool add = accumulate || k0 > 0;
    for (int64_t n0 = 0; n0 < n; n0 += kGemmNc) {
      const int64_t nb = n - n0 < kGemmNc ? n - n0 : kGemmNc;
      for (int64_t m0 = 0; m0 < m; m0 += 4) {
        const int64_t mr = m - m0 < 4 ? m - m0 : 4;
        for (int64_t j0 = n0; j0 < n0 + nb; j0 += 4) {
          const int64_t nr = n0 + nb - j0 < 4 ? n0 + nb - j0 : 4;
          MicroTable::Get(mr, nr)(x + m0 * ldx + k0, ldx, w + j0 * ldw + k0, ldw,
                                  y + m0 * ldy + j0, ldy, kb, add);
        }
      }
    }
  }
}

// Builds the 4 x 4 table of Micro<MR, NR> instantiations.
// A plain local table, not a function-local static (see the namespace comment).
template <template <int, int> class Micro>
struct MicroTable4x4 {
  using Fn = decltype(&Micro<1, 1>::Run);
  static Fn Get(int64_t mr, int64_t nr) {
    const Fn kTable[4][4] = {
        {&Micro<1, 1>::Run, &Micro<1, 2>::Run, &Micro<1, 3>::Run, &Micro<1, 4>::Run},
        {&Micro<2, 1>::Run, &Micro<2, 2>::Run, &Micro<2, 3>::Run, &Micro<2, 4>::Run},
        {&Micro<3, 1>::Run, &Micro<3, 2>::Run, &Micro<3, 3>::Run, &Micro<3, 4>::Run},
        {&Micro<4, 1>::Run, &Micro<4, 2>::Run, &Micro<4, 3>::Run, &Micro<4, 4>::Run}};
    return kTable[mr - 1][nr - 1];
  }
};

}  // namespace
}  // namespace tandem::kernels::internal

#endif  // TANDEM_KERNELS_CPU_GEMM_TILING_H_
