#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/model/bf16.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

std::string JoinPath(const std::string& dir, absl::string_view name) {
  if (dir.empty() || dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path, ": cannot open: ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return DataLoss(path, ": read failed");
  return ss.str();
}

template <typename T>
absl::StatusOr<absl::Span<const T>> Typed(const TensorView& view, DType want) {
  if (view.dtype != want) {
    return InvalidArgument("tensor '", view.name, "' is ", DTypeName(view.dtype),
                           ", not ", DTypeName(want));
  }
  if (reinterpret_cast<uintptr_t>(view.data) % alignof(T) != 0) {
    return FailedPrecondition("tensor '", view.name, "' in ", view.file,
                              " is not aligned to ", alignof(T), " bytes");
  }
  return absl::Span<const T>(reinterpret_cast<const T*>(view.data),
                             view.nbytes / sizeof(T));
}

}  // namespace

uint64_t TensorView::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string TensorView::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<absl::Span<const float>> TensorView::F32() const {
  return Typed<float>(*this, DType::kF32);
}
absl::StatusOr<absl::Span<const uint16_t>> TensorView::BF16Bits() const {
  return Typed<uint16_t>(*this, DType::kBF16);
}
absl::StatusOr<absl::Span<const uint8_t>> TensorView::U8() const {
  return Typed<uint8_t>(*this, DType::kU8);
}

absl::StatusOr<std::vector<float>> TensorView::ToFloat() const {
  const uint64_t n = num_elements();
  std::vector<float> out(n);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out.data(), data, n * 4);
      break;
    case DType::kBF16:
    case DType::kF16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, data + 2 * i, 2);
        out[i] = dtype == DType::kBF16 ? Bf16ToFloat(bits) : HalfToFloat(bits);
      }
      break;
    default:
      return InvalidArgument("tensor '", name, "': cannot convert ", DTypeName(dtype),
                             " to float");
  }
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path, MapOptions options) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path, ": cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Internal(path, ": fstat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(path, ": not a regular file");
  }
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {
    const int flags = MAP_PRIVATE | (options.populate ? MAP_POPULATE : 0);
    void* p = ::mmap(nullptr, file->size_, PROT_READ, flags, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return Internal(path, ": mmap of ", file->size_, " bytes: ", std::strerror(err));
    }
    file->base_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file referenced
  absl::string_view bytes(reinterpret_cast<const char*>(file->base_),
                          static_cast<size_t>(file->size_));
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(bytes, file->size_);
  if (!header.ok()) return Annotate(header.status(), path);
  file->header_ = *std::move(header);
  for (size_t i = 0; i < file->header_.tensors.size(); ++i) {
    file->index_.emplace(file->header_.tensors[i].name, i);
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const TensorEntry* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

TensorView SafetensorsFile::View(const TensorEntry& entry) const {
  TensorView view;
  view.name = entry.name;
  view.file = path_;
  view.dtype = entry.dtype;
  view.shape = entry.shape;
  view.data = base_ + header_.data_start + entry.begin;
  view.nbytes = entry.nbytes();
  return view;
}

absl::StatusOr<std::unique_ptr<SafetensorsSet>> SafetensorsSet::OpenFile(
    const std::string& path, MapOptions options) {
  auto set = std::unique_ptr<SafetensorsSet>(new SafetensorsSet());
  TANDEM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path, options));
  for (const TensorEntry& e : file->header().tensors) {
    set->where_.emplace(e.name, Location{file.get(), &e});
  }
  set->files_.push_back(std::move(file));
  return set;
}

absl::StatusOr<std::unique_ptr<SafetensorsSet>> SafetensorsSet::OpenDirectory(
    const std::string& dir, MapOptions options) {
  const std::string index_path = JoinPath(dir, "model.safetensors.index.json");
  if (!FileExists(index_path)) {
    const std::string single = JoinPath(dir, "model.safetensors");
    if (!FileExists(single)) {
      return NotFound(dir,
                      ": neither model.safetensors.index.json nor model.safetensors");
    }
    return OpenFile(single, options);
  }
  TANDEM_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  nlohmann::json index =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded()) return DataLoss(index_path, ": JSON does not parse");
  if (!index.is_object()) return DataLoss(index_path, ": not a JSON object");
  auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return DataLoss(index_path, ": missing or non-object \"weight_map\"");
  }
  if (map_it->empty()) return DataLoss(index_path, ": \"weight_map\" is empty");
  // tensor → shard file name; shards opened once each, in sorted order.
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [tensor, shard] : map_it->items()) {
    if (!shard.is_string()) {
      return DataLoss(index_path, ": weight_map[\"", tensor, "\"] is not a string");
    }
    const std::string& shard_name = shard.get_ref<const std::string&>();
    if (shard_name.empty() || shard_name.find('/') != std::string::npos ||
        shard_name == "." || shard_name == "..") {
      return DataLoss(index_path, ": weight_map[\"", tensor, "\"] names shard \"",
                      shard_name, "\", which is not a plain file name");
    }
    by_shard[shard_name].push_back(tensor);
  }
  for (const auto& [shard_name, tensors] : by_shard) {
    if (!FileExists(JoinPath(dir, shard_name))) {
      return NotFound(index_path, ": shard ", shard_name, " (holding '",
                      tensors.front(), "' and ", tensors.size() - 1,
                      " more) does not exist");
    }
  }
  auto set = std::unique_ptr<SafetensorsSet>(new SafetensorsSet());
  for (const auto& [shard_name, tensors] : by_shard) {
    const std::string path = JoinPath(dir, shard_name);
    TANDEM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path, options));
    std::set<absl::string_view> listed(tensors.begin(), tensors.end());
    for (const std::string& tensor : tensors) {
      const TensorEntry* entry = file->Find(tensor);
      if (entry == nullptr) {
        return NotFound(index_path, ": tensor '", tensor, "' is mapped to ", path,
                        ", which does not contain it");
      }
      set->where_.emplace(tensor, Location{file.get(), entry});
    }
    for (const TensorEntry& e : file->header().tensors) {
      if (listed.count(e.name) == 0) {
        return DataLoss(path, ": tensor '", e.name, "' is not listed in ", index_path,
                        " for this shard");
      }
    }
    set->files_.push_back(std::move(file));
  }
  return set;
}

std::vector<std::string> SafetensorsSet::Names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, unused] : where_) names.push_back(name);
  return names;
}

bool SafetensorsSet::Contains(absl::string_view name) const {
  return where_.find(name) != where_.end();
}

absl::StatusOr<TensorView> SafetensorsSet::Get(absl::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    return NotFound("tensor '", name, "' is not in the checkpoint");
  return it->second.file->View(*it->second.entry);
}

uint64_t SafetensorsSet::total_tensor_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, loc] : where_) total += loc.entry->nbytes();
  return total;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorData>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorData*> order;
  std::set<absl::string_view> seen;
  for (const TensorData& t : tensors) {
    if (t.name.empty()) return InvalidArgument(path, ": empty tensor name");
    if (!seen.insert(t.name).second) {
      return InvalidArgument(path, ": tensor '", t.name, "' given twice");
    }
    uint64_t n = DTypeSize(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0)
        return InvalidArgument(path, ": tensor '", t.name, "' has a negative dim");
      n *= static_cast<uint64_t>(d);
    }
    if (n != t.bytes.size()) {
      return InvalidArgument(path, ": tensor '", t.name, "' has ", t.bytes.size(),
                             " bytes, shape needs ", n);
    }
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const TensorData* a, const TensorData* b) {
    size_t sa = DTypeSize(a->dtype), sb = DTypeSize(b->dtype);
    if (sa != sb) return sa > sb;
    return a->name < b->name;
  });
  std::vector<TensorEntry> entries;
  uint64_t offset = 0;
  for (const TensorData* t : order) {
    TensorEntry e;
    e.name = t->name;
    e.dtype = t->dtype;
    e.shape = t->shape;
    e.begin = offset;
    e.end = offset + t->bytes.size();
    offset = e.end;
    entries.push_back(std::move(e));
  }
  std::string header;
  try {
    header = SerializeSafetensorsHeader(entries, metadata);
  } catch (const std::exception& e) {  // nlohmann rejects non-UTF-8 names
    return InvalidArgument(path, ": cannot serialise header: ", e.what());
  }
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return Internal(tmp, ": cannot create: ", std::strerror(errno));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const TensorData* t : order) {
    out.write(t->bytes.data(), static_cast<std::streamsize>(t->bytes.size()));
  }
  out.close();
  if (!out) return Internal(tmp, ": write failed");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Internal(path, ": rename: ", std::strerror(errno));
  }
  return absl::OkStatus();
}

}  // namespace tandem::model
