#include "engine/grammar/token_vocabulary.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::grammar {

std::string StructureTokenBytes(int index) {
  return std::string{'\xFF', static_cast<char>(index + 1)};
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::FromTokenizer(
    const tokenizer::Tokenizer& tokenizer, absl::Span<const int32_t> stop_token_ids) {
  std::vector<std::string> bytes(tokenizer.vocab_size());
  for (int id = 0; id < tokenizer.vocab_size() && id < tokenizer::kNumBaseTokens;
       ++id) {
    absl::Status s = tokenizer.AppendTokenBytes(id, &bytes[id]);
    if (!s.ok()) return s;
    // Never valid UTF-8 (no grammar's text reads it): keeps the structure
    // tokens' spellings out of reach of text.
    if (bytes[id].find('\xFF') != std::string::npos) bytes[id].clear();
  }
  for (int i = 0; i < kNumStructureTokens; ++i) {
    const int32_t id = kStructureTokenIds[i];
    if (id < tokenizer.vocab_size()) bytes[id] = StructureTokenBytes(i);
  }
  return Build(std::move(bytes), stop_token_ids);
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::FromTokens(
    std::vector<std::string> token_bytes, std::vector<bool> special,
    absl::Span<const int32_t> stop_token_ids) {
  if (!special.empty() && special.size() != token_bytes.size()) {
    return absl::InvalidArgumentError("special flags and tokens differ in size");
  }
  for (size_t i = 0; i < special.size(); ++i) {
    if (special[i]) token_bytes[i].clear();
  }
  return Build(std::move(token_bytes), stop_token_ids);
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::Build(
    std::vector<std::string> bytes, absl::Span<const int32_t> stop_ids) {
  if (bytes.empty()) return absl::InvalidArgumentError("empty vocabulary");
  std::shared_ptr<TokenVocabulary> v(new TokenVocabulary());
  v->bytes_ = std::move(bytes);
  for (int32_t id : stop_ids) {
    if (id < 0 || id >= v->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop token id ", id, " is outside the vocabulary"));
    }
    // A stop token is only ever a stop token, never text of the grammar.
    v->bytes_[id].clear();
    v->stop_ids_.push_back(id);
  }
  std::sort(v->stop_ids_.begin(), v->stop_ids_.end());
  v->stop_ids_.erase(std::unique(v->stop_ids_.begin(), v->stop_ids_.end()),
                     v->stop_ids_.end());
  v->matchable_mask_.assign(v->bitmask_words(), 0);
  for (int32_t id = 0; id < v->size(); ++id) {
    if (v->bytes_[id].empty()) continue;
    v->sorted_.push_back(id);
    v->matchable_mask_[id / 32] |= 1u << (id % 32);
    v->max_len_ = std::max<int32_t>(v->max_len_, v->bytes_[id].size());
  }
  const auto& b = v->bytes_;
  std::sort(v->sorted_.begin(), v->sorted_.end(),
            [&b](int32_t x, int32_t y) { return b[x] < b[y]; });
  v->lcp_.assign(v->sorted_.size(), 0);
  for (size_t i = 1; i < v->sorted_.size(); ++i) {
    const std::string& p = b[v->sorted_[i - 1]];
    const std::string& q = b[v->sorted_[i]];
    size_t n = std::min(p.size(), q.size());
    size_t k = 0;
    while (k < n && p[k] == q[k]) ++k;
    v->lcp_[i] = static_cast<int32_t>(k);
  }
  const size_t n = v->sorted_.size();
  v->sorted_offsets_.assign(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    v->sorted_offsets_[i] = static_cast<uint32_t>(v->sorted_bytes_.size());
    v->sorted_bytes_ += b[v->sorted_[i]];
  }
  v->sorted_offsets_[n] = static_cast<uint32_t>(v->sorted_bytes_.size());
  // Next strictly smaller lcp to the right (a monotonic stack).
  v->next_shorter_.assign(n, static_cast<int32_t>(n));
  std::vector<int32_t> stack;
  for (size_t i = 0; i < n; ++i) {
    while (!stack.empty() && v->lcp_[i] < v->lcp_[stack.back()]) {
      v->next_shorter_[stack.back()] = static_cast<int32_t>(i);
      stack.pop_back();
    }
    stack.push_back(static_cast<int32_t>(i));
  }
  return std::shared_ptr<const TokenVocabulary>(std::move(v));
}

bool TokenVocabulary::is_stop(int32_t id) const {
  return std::binary_search(stop_ids_.begin(), stop_ids_.end(), id);
}

}  // namespace tandem::grammar
