#include "router/structured_output_check.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/sampling/proto_convert.h"
#include "engine/sampling/structured_output.h"

namespace tandem::router {

StructuredOutputCheck::StructuredOutputCheck(const tokenizer::Tokenizer* tokenizer,
                                             int64_t vocab_size)
    : tokenizer_(tokenizer), vocab_size_(vocab_size) {}

absl::Status StructuredOutputCheck::Check(const tandem::v1::StructuredOutput& so) {
  TANDEM_ASSIGN_OR_RETURN(engine::StructuredOutputSpec spec,
                          engine::StructuredOutputFromProto(so));
  if (vocab_size_ > 0) TANDEM_RETURN_IF_ERROR(spec.ValidateForVocab(vocab_size_));
  if (tokenizer_ == nullptr) return absl::OkStatus();
  grammar::GrammarCompiler* compiler = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (compiler_ == nullptr && vocab_status_.ok()) {
      std::vector<int32_t> stops;
      for (int id : tokenizer_->stop_ids()) stops.push_back(id);
      auto vocab = grammar::TokenVocabulary::FromTokenizer(*tokenizer_, stops);
      if (vocab.ok()) {
        compiler_ = std::make_unique<grammar::GrammarCompiler>(*std::move(vocab));
      } else {
        vocab_status_ = vocab.status();
      }
    }
    if (!vocab_status_.ok()) {
      return Internal("structured_output: the vocabulary cannot be built: ",
                      vocab_status_.message());
    }
    compiler = compiler_.get();  // thread-safe; lives as long as this
  }
  absl::Status s = compiler->Compile(engine::GrammarSpecOf(spec)).status();
  if (s.ok()) return s;
  const std::string what(engine::StructuredOutputKindName(spec.kind));
  if (absl::IsResourceExhausted(s)) {
    return InvalidArgument("structured_output: the ", what,
                           " is too large or too deep to compile: ", s.message());
  }
  if (absl::IsInvalidArgument(s) || absl::IsUnimplemented(s)) {
    return InvalidArgument("structured_output: ", what, ": ", s.message());
  }
  return s;
}

}  // namespace tandem::router
