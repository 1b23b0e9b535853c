#include "gateway/stop_matcher.h"

#include <algorithm>

namespace tandem::gateway {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops) {
    if (s.empty()) continue;
    max_len_ = std::max(max_len_, s.size());
    stops_.push_back(std::move(s));
  }
}

bool StopMatcher::Feed(absl::string_view text, std::string* out) {
  if (matched_) return true;
  if (stops_.empty()) {
    out->append(text.data(), text.size());
    return false;
  }
  held_.append(text.data(), text.size());
  // The earliest match wins.
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    out->append(held_, 0, first);
    held_.clear();
    matched_ = true;
    return true;
  }
  // Hold the longest suffix that is a proper prefix of some stop string.
  size_t keep = 0;
  const size_t limit = std::min(held_.size(), max_len_ - 1);
  for (size_t len = limit; len > 0 && keep == 0; --len) {
    absl::string_view suffix = absl::string_view(held_).substr(held_.size() - len);
    for (const std::string& s : stops_) {
      if (s.size() > len && absl::string_view(s).substr(0, len) == suffix) {
        keep = len;
        break;
      }
    }
  }
  out->append(held_, 0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return false;
}

void StopMatcher::Flush(std::string* out) {
  if (matched_) return;
  out->append(held_);
  held_.clear();
}

}  // namespace tandem::gateway
