#include "kernels/backend_factory.h"

#include "common/status.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"

namespace tandem::kernels {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name) {
  if (name == "cpu") return CreateCpuBackend(ActiveIsa(), /*threads=*/0);
  if (name == "cpu_reference") return CreateReferenceBackend();
  return InvalidArgument("unknown kernel backend \"", name,
                         "\" (known: cpu, cpu_reference)");
}

}  // namespace tandem::kernels
