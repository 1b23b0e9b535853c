// The oracle backend: plain, obviously-correct loops with fp64 accumulation,
// single-threaded. Every other backend is tested against it
// (kernels/conformance_test.cc). Not meant to be fast.
#ifndef TANDEM_KERNELS_CPU_REFERENCE_BACKEND_H_
#define TANDEM_KERNELS_CPU_REFERENCE_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace tandem::kernels {

std::unique_ptr<Backend> CreateReferenceBackend();

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_REFERENCE_BACKEND_H_
