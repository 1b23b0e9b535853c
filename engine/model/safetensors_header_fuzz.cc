// libFuzzer harness: ParseSafetensorsHeader must never crash, leak or hit UB on
// arbitrary bytes, and any header it accepts must describe in-bounds,
// non-overlapping, correctly sized tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "engine/model/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto header = tandem::model::ParseSafetensorsHeader(bytes, size);
  if (!header.ok()) return 0;
  const tandem::model::TensorEntry* previous = nullptr;
  for (const auto& t : header->tensors) {
    if (t.end < t.begin || t.end > header->data_bytes) std::abort();
    if (t.nbytes() != t.num_elements() * tandem::model::DTypeSize(t.dtype))
      std::abort();
    if (previous != nullptr && !(previous->name < t.name)) std::abort();
    previous = &t;
  }
  if (header->data_start + header->data_bytes != size) std::abort();
  return 0;
}
