#include "gateway/sse.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::gateway {

std::string SseEvent(absl::string_view data) {
  std::string out = "data: ";
  out.reserve(data.size() + 8);
  for (char c : data) {
    if (c == '\r') continue;
    if (c == '\n') {
      out += "\ndata: ";
    } else {
      out += c;
    }
  }
  out += "\n\n";
  return out;
}

void SseParser::Feed(absl::string_view bytes, std::vector<std::string>* events) {
  // Line by line (memchr, not a byte at a time: the benchmark's client parses
  // every SSE byte it measures); a "\r" anywhere is dropped.
  while (!bytes.empty()) {
    const size_t nl = bytes.find('\n');
    const absl::string_view piece = bytes.substr(0, nl);
    if (piece.find('\r') == absl::string_view::npos) {
      line_.append(piece.data(), piece.size());
    } else {
      for (char c : piece) {
        if (c != '\r') line_ += c;
      }
    }
    if (nl == absl::string_view::npos) return;
    bytes.remove_prefix(nl + 1);
    EndLine(events);
  }
}

void SseParser::EndLine(std::vector<std::string>* events) {
  if (line_.empty()) {  // blank line: dispatch
    if (has_data_) events->push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (absl::StartsWith(line_, "data:")) {
    absl::string_view value = absl::string_view(line_).substr(5);
    if (absl::StartsWith(value, " ")) value.remove_prefix(1);
    if (has_data_) data_ += '\n';
    absl::StrAppend(&data_, value);
    has_data_ = true;
  }
  line_.clear();
}

}  // namespace tandem::gateway
