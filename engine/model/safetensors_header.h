// The safetensors file header: dtypes and the parser of the JSON header that
// maps tensor names to {dtype, shape, byte range}.
//
// File layout (Hugging Face safetensors):
//   [8 bytes: N, little-endian u64][N bytes: UTF-8 JSON header][data buffer]
// The JSON header is an object: tensor name -> {"dtype": "BF16", "shape": [..],
// "data_offsets": [begin, end]} with offsets relative to the start of the data
// buffer, plus an optional "__metadata__" object of string -> string.
//
// This file has no dependency beyond absl status/strings and nlohmann-json (it is
// compiled directly into the libFuzzer harness safetensors_header_fuzz.cc).
#ifndef TANDEM_ENGINE_MODEL_SAFETENSORS_HEADER_H_
#define TANDEM_ENGINE_MODEL_SAFETENSORS_HEADER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::model {

enum class DType {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
  kF8E4M3,
  kF8E5M2,
};

// "BF16", "F32", "F8_E4M3", ... (the safetensors spelling).
absl::string_view DTypeName(DType dtype);
// Parses the safetensors spelling; false on an unknown name.
bool ParseDType(absl::string_view name, DType* out);
// Bytes per element.
size_t DTypeSize(DType dtype);

// Upper bound on the JSON header length accepted by the parser (100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1000 * 1000;

struct TensorEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets relative to the data buffer
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
  uint64_t num_elements() const;
  bool operator==(const TensorEntry&) const = default;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;                    // N (the JSON length, padding included)
  uint64_t data_start = 0;                      // 8 + N: file offset of the data buffer
  uint64_t data_bytes = 0;                      // file_size - data_start
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<TensorEntry> tensors;             // sorted by name
};

// Parses and validates a safetensors header. `bytes` holds at least the first
// 8 + N bytes of the file (more is fine; only the header is read) and
// `file_size` is the size of the whole file. Never crashes on corrupt input;
// errors say what is wrong and with which tensor:
//  - fewer than 8 bytes, N > kMaxSafetensorsHeaderBytes, 8 + N > file_size or
//    8 + N > bytes.size();
//  - JSON that does not parse, is not an object, or repeats a key;
//  - a tensor entry that is not an object, lacks or mistypes "dtype", "shape" or
//    "data_offsets", names an unknown dtype, has a negative or non-integer
//    dimension, begin > end, end beyond the data buffer, or a byte length that is
//    not product(shape) * dtype size (overflow checked);
//  - two tensors whose byte ranges overlap (gaps between tensors are allowed);
//  - "__metadata__" that is not an object of strings.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view bytes,
                                                         uint64_t file_size);

// Serialises a header for the given entries (offsets as given), padded with
// spaces to a multiple of 8 bytes, preceded by its 8-byte length. Keys are
// written in sorted order, so the output is deterministic.
std::string SerializeSafetensorsHeader(
    const std::vector<TensorEntry>& tensors,
    const std::map<std::string, std::string>& metadata);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_SAFETENSORS_HEADER_H_
