#include "engine/model/safetensors_header.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using nlohmann::json;

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1},      {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},          {DType::kU16, "U16", 2},
    {DType::kI16, "I16", 2},        {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},      {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},        {DType::kF32, "F32", 4},
    {DType::kU64, "U64", 8},        {DType::kI64, "I64", 8},
    {DType::kF64, "F64", 8},        {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[1];  // unreachable for valid enum values
}

// Maximum JSON nesting accepted (a valid header nests 3 deep).
constexpr int kMaxDepth = 8;
// Maximum number of dimensions of one tensor.
constexpr size_t kMaxRank = 16;

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("safetensors header: ", what));
}

bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

absl::StatusOr<TensorEntry> ParseEntry(const std::string& name, const json& value,
                                       uint64_t data_bytes) {
  auto bad = [&](absl::string_view what) {
    return Corrupt(absl::StrCat("tensor '", name, "': ", what));
  };
  if (name.empty()) return Corrupt("empty tensor name");
  if (!value.is_object()) return bad("entry is not an object");
  TensorEntry entry;
  entry.name = name;

  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) return bad("missing \"dtype\"");
  if (!dtype_it->is_string()) return bad("\"dtype\" is not a string");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  if (!ParseDType(dtype_name, &entry.dtype)) {
    return bad(absl::StrCat("unknown dtype \"", dtype_name, "\""));
  }

  auto shape_it = value.find("shape");
  if (shape_it == value.end()) return bad("missing \"shape\"");
  if (!shape_it->is_array()) return bad("\"shape\" is not an array");
  if (shape_it->size() > kMaxRank) {
    return bad(absl::StrCat("rank ", shape_it->size(), " exceeds ", kMaxRank));
  }
  uint64_t elements = 1;
  for (const json& dim : *shape_it) {
    if (!dim.is_number_unsigned()) {
      return bad("\"shape\" holds a value that is not a non-negative integer");
    }
    uint64_t d = dim.get<uint64_t>();
    if (d > static_cast<uint64_t>(INT64_MAX)) return bad("dimension too large");
    if (MulOverflows(elements, d, &elements)) return bad("element count overflows");
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) return bad("missing \"data_offsets\"");
  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() ||
      !(*offsets_it)[1].is_number_unsigned()) {
    return bad("\"data_offsets\" is not [begin, end] of non-negative integers");
  }
  entry.begin = (*offsets_it)[0].get<uint64_t>();
  entry.end = (*offsets_it)[1].get<uint64_t>();
  if (entry.end < entry.begin) {
    return bad(absl::StrCat("data_offsets end ", entry.end, " < begin ", entry.begin));
  }
  if (entry.end > data_bytes) {
    return bad(absl::StrCat("data_offsets end ", entry.end,
                            " is beyond the data buffer (", data_bytes, " bytes)"));
  }
  uint64_t expected_bytes = 0;
  if (MulOverflows(elements, DTypeSize(entry.dtype), &expected_bytes)) {
    return bad("byte count overflows");
  }
  if (entry.nbytes() != expected_bytes) {
    return bad(absl::StrCat("holds ", entry.nbytes(), " bytes but shape [",
                            absl::StrJoin(entry.shape, ","), "] of ", dtype_name,
                            " needs ", expected_bytes));
  }
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return bad(absl::StrCat("unknown field \"", key, "\""));
    }
  }
  return entry;
}

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

bool ParseDType(absl::string_view name, DType* out) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) {
      *out = info.dtype;
      return true;
    }
  }
  return false;
}

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

uint64_t TensorEntry::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view bytes,
                                                         uint64_t file_size) {
  if (bytes.size() < 8 || file_size < 8) {
    return Corrupt(absl::StrCat("file has ",
                                std::min<uint64_t>(bytes.size(), file_size),
                                " bytes, fewer than the 8-byte length prefix"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > kMaxSafetensorsHeaderBytes) {
    return Corrupt(absl::StrCat("header length ", n, " exceeds the limit of ",
                                kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (n + 8 > file_size) {
    return Corrupt(absl::StrCat("header length ", n, " runs past the end of the ",
                                file_size, "-byte file"));
  }
  if (n + 8 > bytes.size()) {
    return Corrupt(absl::StrCat("header length ", n, " but only ", bytes.size() - 8,
                                " header bytes were given"));
  }
  SafetensorsHeader header;
  header.header_bytes = n;
  header.data_start = 8 + n;
  header.data_bytes = file_size - header.data_start;

  // Duplicate keys and excessive nesting are detected while parsing: nlohmann
  // keeps the last of repeated keys silently.
  std::vector<std::set<std::string>> open_objects;
  std::string problem;
  json::parser_callback_t callback = [&](int depth, json::parse_event_t event,
                                         json& parsed) {
    if (depth > kMaxDepth && problem.empty()) {
      problem = absl::StrCat("JSON nesting deeper than ", kMaxDepth);
    }
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && parsed.is_string()) {
          const std::string& key = parsed.get_ref<const std::string&>();
          if (!open_objects.back().insert(key).second && problem.empty()) {
            problem = absl::StrCat("key \"", key, "\" appears twice");
          }
        }
        break;
      default:
        break;
    }
    return true;
  };
  const char* begin = bytes.data() + 8;
  json root = json::parse(begin, begin + n, callback, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Corrupt("JSON does not parse");
  if (!problem.empty()) return Corrupt(problem);
  if (!root.is_object()) return Corrupt("JSON is not an object");

  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return Corrupt("\"__metadata__\" is not an object");
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          return Corrupt(
              absl::StrCat("\"__metadata__\" value of \"", mkey, "\" is not a string"));
        }
        header.metadata[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    absl::StatusOr<TensorEntry> entry = ParseEntry(key, value, header.data_bytes);
    if (!entry.ok()) return entry.status();
    header.tensors.push_back(*std::move(entry));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });

  // Overlap check over non-empty ranges, in offset order.
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& t : header.tensors) {
    if (t.nbytes() > 0) by_offset.push_back(&t);
  }
  std::sort(
      by_offset.begin(), by_offset.end(),
      [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      return Corrupt(absl::StrCat(
          "tensors '", by_offset[i - 1]->name, "' [", by_offset[i - 1]->begin, ",",
          by_offset[i - 1]->end, ") and '", by_offset[i]->name, "' [",
          by_offset[i]->begin, ",", by_offset[i]->end, ") overlap"));
    }
  }
  return header;
}

std::string SerializeSafetensorsHeader(
    const std::vector<TensorEntry>& tensors,
    const std::map<std::string, std::string>& metadata) {
  json root = json::object();  // std::map-backed: keys come out sorted
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    root["__metadata__"] = meta;
  }
  for (const TensorEntry& t : tensors) {
    json entry = json::object();
    entry["dtype"] = std::string(DTypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {t.begin, t.end};
    root[t.name] = std::move(entry);
  }
  std::string text = root.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

}  // namespace tandem::model
