// Stop strings over streamed text: text is released as soon as it can no
// longer be the start of a stop string; the output ends just before the first
// match (OpenAI semantics: the stop string itself is not returned).
//
//   Feed("Hello wo") → "Hello "   (holds "wo": could begin "world")
//   Feed("rld!")     → ""  matched: true  (stop "world"; "wo" is dropped too)
//
// Text fed in must be valid UTF-8 and the stop strings too; then every piece
// released is valid UTF-8 (a held suffix starts where a stop string starts).
#ifndef TANDEM_GATEWAY_STOP_MATCHER_H_
#define TANDEM_GATEWAY_STOP_MATCHER_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::gateway {

class StopMatcher {
 public:
  // Empty strings in `stops` are ignored.
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends the text that can be released now to `out`. Returns true when a
  // stop string matched (then `out` got the text before it and the matcher
  // ignores further input).
  bool Feed(absl::string_view text, std::string* out);
  // End of the stream: releases what is held.
  void Flush(std::string* out);

  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string held_;
  bool matched_ = false;
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_STOP_MATCHER_H_
