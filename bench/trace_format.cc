#include "bench/trace_format.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {
namespace {

absl::Status LineError(int line_number, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", what));
}

// A JSON number that is a whole, non-negative value representable as int64.
bool WholeNumber(const nlohmann::json& v, int64_t* out) {
  if (v.is_number_unsigned() || v.is_number_integer()) {
    if (v.is_number_integer() && v.get<int64_t>() < 0) return false;
    *out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!(d >= 0) || d != std::floor(d) || d > 9.0e18) return false;
    *out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<TraceRecord> ParseTraceLine(absl::string_view line, int line_number,
                                           int block_tokens) {
  if (block_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size must be >= 1, got ", block_tokens));
  }
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return LineError(line_number, "not valid JSON");
  if (!j.is_object()) return LineError(line_number, "not a JSON object");
  for (const char* key : {"timestamp", "input_length", "output_length", "hash_ids"}) {
    if (!j.contains(key)) {
      return LineError(line_number, absl::StrCat("missing \"", key, "\""));
    }
  }
  TraceRecord r;
  const nlohmann::json& ts = j["timestamp"];
  if (!ts.is_number() || !(ts.get<double>() >= 0) || !std::isfinite(ts.get<double>())) {
    return LineError(line_number, "\"timestamp\" must be a number >= 0 (ms)");
  }
  r.timestamp_ms = ts.get<double>();
  if (!WholeNumber(j["input_length"], &r.input_length) || r.input_length < 1) {
    return LineError(line_number, "\"input_length\" must be a whole number >= 1");
  }
  if (!WholeNumber(j["output_length"], &r.output_length) || r.output_length < 1) {
    return LineError(line_number, "\"output_length\" must be a whole number >= 1");
  }
  const nlohmann::json& ids = j["hash_ids"];
  if (!ids.is_array()) return LineError(line_number, "\"hash_ids\" must be an array");
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t id = 0;
    if (!WholeNumber(ids[i], &id)) {
      return LineError(line_number, absl::StrCat("\"hash_ids\"[", i,
                                                 "] is not a whole number >= 0"));
    }
    r.hash_ids.push_back(id);
  }
  const int64_t blocks = (r.input_length + block_tokens - 1) / block_tokens;
  if (static_cast<int64_t>(r.hash_ids.size()) != blocks) {
    return LineError(line_number,
                     absl::StrCat("input_length ", r.input_length, " needs ", blocks,
                                  " hash_ids of ", block_tokens, " tokens, got ",
                                  r.hash_ids.size()));
  }
  return r;
}

absl::StatusOr<std::vector<TraceRecord>> ParseTrace(absl::string_view text,
                                                    int block_tokens) {
  std::vector<TraceRecord> out;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == absl::string_view::npos) continue;
    absl::StatusOr<TraceRecord> r = ParseTraceLine(line, line_number, block_tokens);
    if (!r.ok()) return r.status();
    if (!out.empty() && r->timestamp_ms < out.back().timestamp_ms) {
      return LineError(line_number, absl::StrCat("timestamp ", r->timestamp_ms,
                                                 " is before the previous line's ",
                                                 out.back().timestamp_ms,
                                                 " (the trace must be in "
                                                 "arrival order)"));
    }
    out.push_back(*std::move(r));
  }
  if (out.empty()) return absl::InvalidArgumentError("the trace has no requests");
  return out;
}

absl::StatusOr<std::vector<TraceRecord>> ReadTraceFile(const std::string& path,
                                                       int block_tokens) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read trace ", path));
  std::stringstream s;
  s << f.rdbuf();
  absl::StatusOr<std::vector<TraceRecord>> r = ParseTrace(s.str(), block_tokens);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(path, ": ", r.status().message()));
  }
  return r;
}

std::string FormatTraceLine(const TraceRecord& r) {
  nlohmann::ordered_json j;
  if (r.timestamp_ms == std::floor(r.timestamp_ms)) {
    j["timestamp"] = static_cast<int64_t>(r.timestamp_ms);
  } else {
    j["timestamp"] = r.timestamp_ms;
  }
  j["input_length"] = r.input_length;
  j["output_length"] = r.output_length;
  j["hash_ids"] = r.hash_ids;
  return j.dump();
}

absl::Status WriteTraceFile(const std::string& path,
                            const std::vector<TraceRecord>& records) {
  std::ofstream f(path, std::ios::trunc);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  for (const TraceRecord& r : records) f << FormatTraceLine(r) << '\n';
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace tandem::bench
