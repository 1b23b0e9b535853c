// Read-only access to Hugging Face safetensors checkpoints, zero-copy over mmap.
//
//   SafetensorsFile   one .safetensors file, mapped read-only (MAP_PRIVATE).
//   SafetensorsSet    a model directory: model.safetensors.index.json + shards
//                     (weight_map), or a single model.safetensors.
//   TensorView        {name, dtype, shape, data, nbytes} pointing into a mapping;
//                     valid while the owning file/set lives.
//
// Directory → Open: read index JSON → open each distinct shard (mmap + parse
// header) → check every index entry is in its shard and every shard tensor is
// in the index → name → (shard, entry) table.
#ifndef TANDEM_ENGINE_MODEL_SAFETENSORS_H_
#define TANDEM_ENGINE_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/model/safetensors_header.h"

namespace tandem::model {

// How files are mapped.
struct MapOptions {
  // MAP_POPULATE: fault the whole file in during Open (one bulk operation, far
  // cheaper than a page fault per 4 KiB on first touch). Use when every tensor
  // will be read anyway (serving); leave off for header-only inspection.
  bool populate = false;
};

struct TensorView {
  std::string name;
  std::string file;  // the file it lives in
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // not owned: points into a read-only mapping
  size_t nbytes = 0;

  uint64_t num_elements() const;
  std::string ShapeString() const;  // "[4,16]"

  // Typed spans; an error (naming the tensor) when the dtype differs or the data
  // is not aligned for T.
  absl::StatusOr<absl::Span<const float>> F32() const;
  absl::StatusOr<absl::Span<const uint16_t>> BF16Bits() const;  // raw bf16 bits
  absl::StatusOr<absl::Span<const uint8_t>> U8() const;
  // Converts BF16, F16 or F32 to float (copies).
  absl::StatusOr<std::vector<float>> ToFloat() const;
};

class SafetensorsFile {
 public:
  // Maps `path` and parses its header; errors name the file.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path,
                                                               MapOptions options = {});
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  const SafetensorsHeader& header() const { return header_; }
  // Null when absent.
  const TensorEntry* Find(absl::string_view name) const;
  TensorView View(const TensorEntry& entry) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;  // mapping of the whole file (owned)
  uint64_t size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;  // name → header_.tensors[i]
};

class SafetensorsSet {
 public:
  // Opens `dir`/model.safetensors.index.json and its shards when the index
  // exists, else `dir`/model.safetensors.
  static absl::StatusOr<std::unique_ptr<SafetensorsSet>> OpenDirectory(
      const std::string& dir, MapOptions options = {});
  // Opens one file as a set of one.
  static absl::StatusOr<std::unique_ptr<SafetensorsSet>> OpenFile(
      const std::string& path, MapOptions options = {});

  // Every tensor name, sorted.
  std::vector<std::string> Names() const;
  size_t size() const { return where_.size(); }
  bool Contains(absl::string_view name) const;
  absl::StatusOr<TensorView> Get(absl::string_view name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  uint64_t total_tensor_bytes() const;

 private:
  SafetensorsSet() = default;
  struct Location {
    const SafetensorsFile* file;  // not owned (files_ owns it)
    const TensorEntry* entry;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Location, std::less<>> where_;
};

// One tensor to write: the bytes are copied into the file as given.
struct TensorData {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Writes a safetensors file: header keys sorted (deterministic), header padded
// with spaces to a multiple of 8, data laid out by descending element size then
// name so that every tensor is aligned to its element size. Errors on duplicate
// names or a byte length that does not match shape*dtype.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorData>& tensors,
                              const std::map<std::string, std::string>& metadata = {
                                  {"format", "pt"}});

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_SAFETENSORS_H_
