// libFuzzer: the OpenAI request parsers never crash, hang or throw on any
// body; what they accept has fields inside the documented ranges.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "gateway/request_parser.h"

namespace {

void Check(bool ok) {
  if (!ok) abort();
}

void CheckFields(const tandem::gateway::GenerationFields& f) {
  Check(f.n >= 1 && f.n <= tandem::gateway::kMaxN);
  Check(!f.temperature || (*f.temperature >= 0 && *f.temperature <= 2));
  Check(!f.top_p || (*f.top_p > 0 && *f.top_p <= 1));
  // 0 only for a score-only completion (echo without generation).
  Check(!f.max_tokens || *f.max_tokens >= 1 || f.ScoreOnly());
  Check(f.top_logprobs >= 0 && f.top_logprobs <= tandem::gateway::kMaxTopLogprobs);
  Check(f.stop.size() <= static_cast<size_t>(tandem::gateway::kMaxStopStrings));
  for (const auto& s : f.stop) Check(!s.empty());
  Check(!f.model.empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view body(reinterpret_cast<const char*>(data), size);
  if (auto chat = tandem::gateway::ParseChatCompletionRequest(body); chat.ok()) {
    CheckFields(chat->fields);
    Check(!chat->messages.empty());
  }
  if (auto completion = tandem::gateway::ParseCompletionRequest(body);
      completion.ok()) {
    CheckFields(completion->fields);
    Check(!completion->prompts.empty());
  }
  return 0;
}
