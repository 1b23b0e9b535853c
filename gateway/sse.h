// Server-Sent Events framing for the streaming OpenAI responses.
//
//   SseEvent("{...}") == "data: {...}\n\n"      one event per chunk
//   kSseDone          == "data: [DONE]\n\n"     the end of an OpenAI stream
//
// SseParser is the reading side (tests, the benchmark): bytes in any split →
// the data of each complete event.
#ifndef TANDEM_GATEWAY_SSE_H_
#define TANDEM_GATEWAY_SSE_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::gateway {

inline constexpr absl::string_view kSseDone = "data: [DONE]\n\n";

// One event carrying `data`; a newline inside `data` starts another `data:`
// line, so any text round-trips (a "\r" is dropped: it would end the line).
std::string SseEvent(absl::string_view data);

class SseParser {
 public:
  // Appends the data of every event that `bytes` completes to `events`
  // (multi-line data joined with "\n"). Comment lines (":") and fields other
  // than `data` are ignored.
  void Feed(absl::string_view bytes, std::vector<std::string>* events);

 private:
  void EndLine(std::vector<std::string>* events);  // line_ is complete

  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_SSE_H_
