#include "engine/sampling/structured_output.h"

#include <algorithm>
#include <utility>

#include "common/status.h"

namespace tandem::engine {
namespace {

void SetBit(absl::Span<uint32_t> mask, int32_t token) {
  mask[token >> 5] |= 1u << (token & 31);
}
bool TestBit(absl::Span<const uint32_t> mask, int32_t token) {
  return (mask[token >> 5] >> (token & 31)) & 1u;
}

}  // namespace

grammar::ConstraintSpec GrammarSpecOf(const StructuredOutputSpec& spec) {
  using K = StructuredOutputSpec::Kind;
  using G = grammar::ConstraintSpec::Kind;
  grammar::ConstraintSpec g;
  switch (spec.kind) {
    case K::kJsonObject:
      g.kind = G::kJsonObject;
      break;
    case K::kJsonSchema:
      g.kind = G::kJsonSchema;
      break;
    case K::kRegex:
      g.kind = G::kRegex;
      break;
    case K::kChoice:
      g.kind = G::kChoice;
      break;
    case K::kEbnf:
      g.kind = G::kEbnf;
      break;
    case K::kToolCalls:
      g.kind = G::kToolCalls;
      break;
  }
  g.source = spec.source;
  g.choices = spec.choices;
  return g;
}

absl::StatusOr<std::unique_ptr<OutputConstraint>> OutputConstraint::Create(
    std::shared_ptr<const grammar::CompiledGrammar> grammar,
    const StructuredOutputSpec& spec, absl::Span<const int32_t> stop_token_ids,
    int64_t grammar_vocab_size, int64_t vocab_size, int max_rollback) {
  if (grammar == nullptr) return InvalidArgument("structured output: no grammar");
  if (vocab_size <= 0 || grammar_vocab_size <= 0 || grammar_vocab_size > vocab_size) {
    return InvalidArgument("structured output: vocabulary of ", grammar_vocab_size,
                           " tokens for a model of ", vocab_size);
  }
  TANDEM_RETURN_IF_ERROR(spec.ValidateForVocab(vocab_size));
  if (stop_token_ids.empty()) {
    return InvalidArgument("structured output: the model has no stop token");
  }
  std::unique_ptr<OutputConstraint> c(new OutputConstraint());
  c->spec_ = spec;
  c->stop_ids_.assign(stop_token_ids.begin(), stop_token_ids.end());
  for (int32_t id : c->stop_ids_) {
    if (id < 0 || id >= vocab_size) {
      return InvalidArgument("structured output: stop token ", id, " out of range");
    }
  }
  c->vocab_size_ = vocab_size;
  c->grammar_vocab_size_ = grammar_vocab_size;
  c->grammar_words_ = (grammar_vocab_size + 31) / 32;
  c->max_rollback_ = std::max(max_rollback, 1);
  c->matcher_ = std::make_unique<grammar::GrammarMatcher>(std::move(grammar),
                                                          c->max_rollback_ + 1);
  c->scratch_.assign(c->mask_words(), 0);
  if (spec.free_until_token_id >= 0) {
    c->phase_ = Phase::kFree;
  } else if (!spec.prefix_token_ids.empty()) {
    c->phase_ = Phase::kPrefix;
  } else {
    c->phase_ = Phase::kGrammar;
  }
  return c;
}

bool OutputConstraint::IsStop(int32_t token) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

void OutputConstraint::FillGrammar(absl::Span<uint32_t> mask) {
  std::fill(mask.begin(), mask.end(), 0u);
  matcher_->FillNextTokenBitmask(mask.subspan(0, grammar_words_));
  // Ids past the grammar's vocabulary (a padded model vocabulary) stay unset
  // even where the matcher's last word has spare bits.
  if (grammar_vocab_size_ % 32 != 0) {
    mask[grammar_words_ - 1] &= (1u << (grammar_vocab_size_ % 32)) - 1;
  }
  if (spec_.terminator_token_id < 0) return;
  // The grammar's end is written as the terminator, not as a stop token.
  for (int32_t id : stop_ids_) mask[id >> 5] &= ~(1u << (id & 31));
  if (matcher_->CanTerminate()) SetBit(mask, spec_.terminator_token_id);
}

void OutputConstraint::FillNextTokenBitmask(absl::Span<uint32_t> mask) {
  switch (phase_) {
    case Phase::kFree: {
      std::fill(mask.begin(), mask.end(), ~0u);
      // Bits past the vocabulary are cleared (the sampler reads only ids < V).
      if (vocab_size_ % 32 != 0) {
        mask[mask_words() - 1] = (1u << (vocab_size_ % 32)) - 1;
      }
      for (int32_t id : spec_.free_banned_token_ids) {
        mask[id >> 5] &= ~(1u << (id & 31));
      }
      SetBit(mask, spec_.free_until_token_id);
      return;
    }
    case Phase::kPrefix:
      std::fill(mask.begin(), mask.end(), 0u);
      SetBit(mask, spec_.prefix_token_ids[index_]);
      return;
    case Phase::kGrammar:
      FillGrammar(mask);
      return;
    case Phase::kSuffix:
      std::fill(mask.begin(), mask.end(), 0u);
      SetBit(mask, spec_.suffix_token_ids[index_]);
      return;
    case Phase::kDone:
      std::fill(mask.begin(), mask.end(), 0u);
      for (int32_t id : stop_ids_) SetBit(mask, id);
      return;
  }
}

bool OutputConstraint::Allows(int32_t token) {
  if (token < 0 || token >= vocab_size_) return false;
  FillNextTokenBitmask(absl::MakeSpan(scratch_));
  return TestBit(scratch_, token);
}

absl::Status OutputConstraint::Accept(int32_t token) {
  auto refuse = [&] {
    return InvalidArgument("structured output: token ", token,
                           " is not allowed by the constraint here");
  };
  if (token < 0 || token >= vocab_size_) return refuse();
  Point before{phase_, index_, false};
  switch (phase_) {
    case Phase::kFree:
      if (token != spec_.free_until_token_id &&
          std::find(spec_.free_banned_token_ids.begin(),
                    spec_.free_banned_token_ids.end(),
                    token) != spec_.free_banned_token_ids.end()) {
        return refuse();
      }
      if (token == spec_.free_until_token_id) {
        index_ = 0;
        phase_ = spec_.prefix_token_ids.empty() ? Phase::kGrammar : Phase::kPrefix;
      }
      break;
    case Phase::kPrefix:
      if (token != spec_.prefix_token_ids[index_]) return refuse();
      if (++index_ == static_cast<int32_t>(spec_.prefix_token_ids.size())) {
        index_ = 0;
        phase_ = Phase::kGrammar;
      }
      break;
    case Phase::kGrammar:
      if (spec_.terminator_token_id >= 0 && token == spec_.terminator_token_id) {
        // The terminator (a structure token, never grammar text): allowed where
        // the grammar may end; the suffix follows.
        if (!matcher_->CanTerminate()) return refuse();
        index_ = 0;
        phase_ = spec_.suffix_token_ids.empty() ? Phase::kDone : Phase::kSuffix;
        break;
      }
      if (token >= grammar_vocab_size_) return refuse();
      if (spec_.terminator_token_id >= 0 && IsStop(token)) return refuse();
      if (!matcher_->AcceptToken(token)) return refuse();
      before.grammar_token = true;
      if (matcher_->IsTerminated()) phase_ = Phase::kDone;
      break;
    case Phase::kSuffix:
      if (token != spec_.suffix_token_ids[index_]) return refuse();
      if (++index_ == static_cast<int32_t>(spec_.suffix_token_ids.size())) {
        index_ = 0;
        phase_ = Phase::kDone;
      }
      break;
    case Phase::kDone:
      if (!IsStop(token)) return refuse();
      break;
  }
  history_.push_back(before);
  if (static_cast<int>(history_.size()) > max_rollback_) {
    history_.erase(history_.begin());
  }
  return absl::OkStatus();
}

absl::Status OutputConstraint::Rollback(int n) {
  if (n < 0 || n > static_cast<int>(history_.size())) {
    return InvalidArgument("structured output: cannot roll back ", n, " tokens (",
                           history_.size(), " kept)");
  }
  int grammar_tokens = 0;
  Point p{phase_, index_, false};
  for (int k = 0; k < n; ++k) {
    p = history_.back();
    history_.pop_back();
    grammar_tokens += p.grammar_token ? 1 : 0;
  }
  if (grammar_tokens > 0) TANDEM_RETURN_IF_ERROR(matcher_->Rollback(grammar_tokens));
  phase_ = p.phase;
  index_ = p.index;
  return absl::OkStatus();
}

}  // namespace tandem::engine
