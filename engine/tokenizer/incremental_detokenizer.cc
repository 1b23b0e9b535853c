#include "engine/tokenizer/incremental_detokenizer.h"

#include "common/status.h"
#include "engine/tokenizer/utf8.h"

namespace tandem::tokenizer {

absl::StatusOr<std::string> IncrementalDetokenizer::Add(int id) {
  if (!tokenizer_->IsValidId(id)) {
    return InvalidArgument("token id ", id, " outside [0, ", tokenizer_->vocab_size(),
                           ")");
  }
  if (options_.skip_special_tokens && tokenizer_->IsSpecial(id)) return std::string();
  TANDEM_RETURN_IF_ERROR(tokenizer_->AppendTokenBytes(id, &pending_));
  std::string out;
  absl::string_view rest(pending_);
  size_t i = 0;
  while (i < rest.size()) {
    if (static_cast<uint8_t>(rest[i]) < 0x80) {
      out.push_back(rest[i]);
      ++i;
      continue;
    }
    const Utf8Step step = ReadUtf8(rest.substr(i));
    if (step.kind == Utf8Step::kIncomplete) break;  // wait for more bytes
    if (step.kind == Utf8Step::kValid) {
      out.append(rest.data() + i, step.length);
    } else {
      out.append(kReplacementChar.data(), kReplacementChar.size());
    }
    i += step.length;
  }
  pending_.erase(0, i);
  return out;
}

std::string IncrementalDetokenizer::Flush() {
  std::string out = ReplaceInvalidUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::tokenizer
