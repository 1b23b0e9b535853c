// The router's check of a request's structured output (proto
// StructuredOutput): the fields are validated and the grammar is compiled once
// over the model's vocabulary, so that an unsupported feature or a grammar over
// the compile budget is one INVALID_ARGUMENT (the gateway's 400 naming the
// feature) before any worker is involved. The compiler caches by spec, so a
// repeated schema costs a lookup. Thread-safe.
#ifndef TANDEM_ROUTER_STRUCTURED_OUTPUT_CHECK_H_
#define TANDEM_ROUTER_STRUCTURED_OUTPUT_CHECK_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "engine/grammar/grammar.h"
#include "engine/tokenizer/tokenizer.h"
#include "proto/common.pb.h"

namespace tandem::router {

class StructuredOutputCheck {
 public:
  // `tokenizer` (not owned, may be null: then only the fields are checked and
  // the workers compile) must outlive this.
  explicit StructuredOutputCheck(const tokenizer::Tokenizer* tokenizer,
                                 int64_t vocab_size);

  // OK, or INVALID_ARGUMENT "structured_output: ..." (a compile budget
  // exceeded says so: too large or too deep).
  absl::Status Check(const tandem::v1::StructuredOutput& so);

 private:
  const tokenizer::Tokenizer* const tokenizer_;
  const int64_t vocab_size_;
  absl::Mutex mu_;
  std::unique_ptr<grammar::GrammarCompiler> compiler_ ABSL_GUARDED_BY(mu_);
  absl::Status vocab_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_STRUCTURED_OUTPUT_CHECK_H_
