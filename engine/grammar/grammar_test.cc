#include "engine/grammar/grammar.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "re2/re2.h"

namespace tandem::grammar {
namespace {

constexpr char kModelDir[] = "third_party/kimi_k3_tokenizer";

std::shared_ptr<const TokenVocabulary> K3Vocab() {
  static const auto* vocab = [] {
    auto t = tokenizer::Tokenizer::Load(kModelDir);
    EXPECT_TRUE(t.ok()) << t.status();
    std::vector<int32_t> stops = {tokenizer::kEosId, tokenizer::kEndOfMsgId};
    auto v = TokenVocabulary::FromTokenizer(**t, stops);
    EXPECT_TRUE(v.ok()) << v.status();
    return new std::shared_ptr<const TokenVocabulary>(*v);
  }();
  return *vocab;
}

GrammarCompiler& Compiler() {
  static auto* c = new GrammarCompiler(K3Vocab(), CompileLimits());
  return *c;
}

std::shared_ptr<const CompiledGrammar> MustCompile(ConstraintSpec::Kind kind,
                                                   std::string source) {
  ConstraintSpec spec;
  spec.kind = kind;
  spec.source = std::move(source);
  auto g = Compiler().Compile(spec);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

bool Bit(const std::vector<uint32_t>& mask, int32_t id) {
  return (mask[id >> 5] >> (id & 31)) & 1;
}

// The allowed set by brute force: every token tried with AcceptToken (which
// never uses the mask cache) and undone.
void ExpectMaskMatchesBruteForce(GrammarMatcher* m) {
  const TokenVocabulary& vocab = m->grammar().vocab();
  std::vector<uint32_t> mask(vocab.bitmask_words());
  m->FillNextTokenBitmask(absl::MakeSpan(mask));
  int mismatches = 0;
  for (int32_t id = 0; id < vocab.size(); ++id) {
    bool ok = m->AcceptToken(id);
    if (ok) {
      ASSERT_TRUE(m->Rollback(1).ok());
    }
    if (ok != Bit(mask, id) && ++mismatches < 5) {
      ADD_FAILURE() << "token " << id << " '" << vocab.token_bytes(id)
                    << "' brute force " << ok << " mask " << Bit(mask, id);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// Samples allowed tokens until a stop token (or `max_tokens`); returns the
// bytes. Checks the mask against brute force every `check_every` steps.
std::string RandomWalk(std::shared_ptr<const CompiledGrammar> g, uint32_t seed,
                       int max_tokens, int check_every, bool* terminated) {
  GrammarMatcher m(g);
  std::mt19937 rng(seed);
  const TokenVocabulary& vocab = g->vocab();
  std::vector<uint32_t> mask(vocab.bitmask_words());
  std::string out;
  *terminated = false;
  for (int step = 0; step < max_tokens; ++step) {
    if (check_every > 0 && step % check_every == 0) ExpectMaskMatchesBruteForce(&m);
    m.FillNextTokenBitmask(absl::MakeSpan(mask));
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < vocab.size(); ++id) {
      if (Bit(mask, id)) allowed.push_back(id);
    }
    EXPECT_FALSE(allowed.empty()) << "dead end after '" << out << "'";
    if (allowed.empty()) break;
    // Prefer ending once possible half of the time so walks terminate.
    int32_t pick = allowed[rng() % allowed.size()];
    if (m.CanTerminate() && rng() % 2 == 0) pick = vocab.stop_token_ids()[0];
    EXPECT_TRUE(m.AcceptToken(pick));
    if (m.IsTerminated()) {
      *terminated = true;
      break;
    }
    out += vocab.token_bytes(pick);
  }
  return out;
}

TEST(GrammarTest, VocabularyExcludesSpecialTokens) {
  auto vocab = K3Vocab();
  EXPECT_EQ(vocab->size(), tokenizer::kVocabSize);
  EXPECT_EQ(vocab->bitmask_words(), tokenizer::kVocabSize / 32);
  EXPECT_FALSE(vocab->matchable(tokenizer::kOpenId));
  EXPECT_FALSE(vocab->matchable(tokenizer::kEosId));
  EXPECT_TRUE(vocab->is_stop(tokenizer::kEosId));
  EXPECT_TRUE(vocab->matchable(100));
}

TEST(GrammarTest, RegexWalksMatchRe2) {
  const std::vector<std::string> patterns = {
      "[a-z]{3,8}",
      "(ab|cd)+x?",
      "\\d{4}-\\d{2}-\\d{2}",
      "[A-Z][a-z]*( [A-Z][a-z]*){0,3}",
      "(0|[1-9][0-9]*)(\\.[0-9]+)?",
      "[^\\n]{1,20}",
      "héllo|wörld",
      "a{2}b{0,3}c+",
  };
  for (size_t p = 0; p < patterns.size(); ++p) {
    auto g = MustCompile(ConstraintSpec::Kind::kRegex, patterns[p]);
    ASSERT_NE(g, nullptr);
    RE2 re(patterns[p]);
    ASSERT_TRUE(re.ok());
    for (uint32_t seed = 0; seed < 4; ++seed) {
      bool done = false;
      std::string out = RandomWalk(g, seed * 31 + p, 64, seed == 0 ? 3 : 0, &done);
      if (done) {
        EXPECT_TRUE(RE2::FullMatch(out, re)) << patterns[p] << " -> " << out;
      }
    }
  }
}

TEST(GrammarTest, ChoiceAllowsOnlyTheChoices) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kChoice;
  spec.choices = {"yes", "no", "maybe not"};
  auto g = Compiler().Compile(spec);
  ASSERT_TRUE(g.ok()) << g.status();
  for (uint32_t seed = 0; seed < 6; ++seed) {
    bool done = false;
    std::string out = RandomWalk(*g, seed, 16, 2, &done);
    ASSERT_TRUE(done);
    EXPECT_TRUE(out == "yes" || out == "no" || out == "maybe not") << out;
  }
}

TEST(GrammarTest, JsonSchemaWalkIsBruteForceExact) {
  auto g = MustCompile(ConstraintSpec::Kind::kJsonSchema, R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 12},
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
      "kind": {"enum": ["a", "b", 3, null]}
    },
    "required": ["name", "age"],
    "additionalProperties": false
  })");
  ASSERT_NE(g, nullptr);
  for (uint32_t seed = 0; seed < 3; ++seed) {
    bool done = false;
    RandomWalk(g, seed, 200, 7, &done);
  }
}

TEST(GrammarTest, JsonObjectModeRecursionIsBruteForceExact) {
  auto g = MustCompile(ConstraintSpec::Kind::kJsonObject, "");
  ASSERT_NE(g, nullptr);
  bool done = false;
  RandomWalk(g, 7, 60, 5, &done);
}

}  // namespace
}  // namespace tandem::grammar
