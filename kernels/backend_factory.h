// Chooses a kernel backend by name at start-up.
#ifndef TANDEM_KERNELS_BACKEND_FACTORY_H_
#define TANDEM_KERNELS_BACKEND_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace tandem::kernels {

// "cpu": optimised, best ISA of this machine capped by $TANDEM_CPU_ISA, one thread
//        per hardware thread;
// "cpu_reference": the oracle (plain loops, single thread).
// Anything else: InvalidArgument (the CUDA backend registers under "cuda" in
// --config=cuda builds, later).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_BACKEND_FACTORY_H_
