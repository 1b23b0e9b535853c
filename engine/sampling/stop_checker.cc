#include "engine/sampling/stop_checker.h"

#include <algorithm>

#include "absl/strings/match.h"

namespace tandem::engine {

StopChecker::StopChecker(const SamplingParams& params,
                         absl::Span<const int32_t> eos_token_ids, int64_t context_room)
    : stop_strings_(params.stop_strings), min_tokens_(params.min_tokens) {
  stop_ids_ = params.stop_token_ids;
  if (!params.ignore_eos) {
    stop_ids_.insert(stop_ids_.end(), eos_token_ids.begin(), eos_token_ids.end());
  }
  std::sort(stop_ids_.begin(), stop_ids_.end());
  stop_ids_.erase(std::unique(stop_ids_.begin(), stop_ids_.end()), stop_ids_.end());
  stop_id_set_.insert(stop_ids_.begin(), stop_ids_.end());
  int64_t limit = params.max_tokens > 0 ? params.max_tokens : 0;
  if (context_room > 0) {
    limit = limit > 0 ? std::min(limit, context_room) : context_room;
  }
  max_new_tokens_ = limit;
}

absl::Span<const int32_t> StopChecker::SuppressedTokens() const {
  if (num_generated_ < min_tokens_) return stop_ids_;
  return {};
}

size_t StopChecker::HoldLength() const {
  size_t best = 0;
  for (const std::string& s : stop_strings_) {
    const size_t longest = std::min(s.size() - 1, pending_.size());
    for (size_t len = longest; len > best; --len) {
      if (absl::EndsWith(pending_, absl::string_view(s).substr(0, len))) {
        best = len;
        break;
      }
    }
  }
  return best;
}

StopUpdate StopChecker::Append(int32_t token_id, absl::string_view text_delta) {
  StopUpdate update;
  if (finished()) {
    update.finish = finish_;
    return update;
  }
  ++num_generated_;
  const bool may_stop = num_generated_ >= min_tokens_;

  if (may_stop && stop_id_set_.contains(token_id)) {
    update.text = std::move(pending_);
    pending_.clear();
    update.finish = finish_ = FinishReason::kStop;
    update.stop_token = token_id;
    return update;
  }

  pending_.append(text_delta.data(), text_delta.size());
  if (may_stop) {
    size_t first = std::string::npos;
    int which = -1;
    for (size_t i = 0; i < stop_strings_.size(); ++i) {
      const size_t at = pending_.find(stop_strings_[i]);
      if (at < first) {
        first = at;
        which = static_cast<int>(i);
      }
    }
    if (which >= 0) {
      update.text = pending_.substr(0, first);
      pending_.clear();
      update.finish = finish_ = FinishReason::kStop;
      update.stop_string_index = which;
      return update;
    }
  }

  if (max_new_tokens_ > 0 && num_generated_ >= max_new_tokens_) {
    update.text = std::move(pending_);
    pending_.clear();
    update.finish = finish_ = FinishReason::kLength;
    return update;
  }

  const size_t hold = HoldLength();
  update.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return update;
}

std::string StopChecker::Flush(FinishReason reason) {
  std::string out = std::move(pending_);
  pending_.clear();
  if (!finished()) finish_ = reason;
  return out;
}

}  // namespace tandem::engine
