#include "engine/grammar/grammar.h"

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
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
  EXPECT_FALSE(vocab->matchable(tokenizer::kEosId));
  EXPECT_FALSE(vocab->matchable(tokenizer::kNumBaseTokens + 100));  // reserved
  EXPECT_TRUE(vocab->is_stop(tokenizer::kEosId));
  EXPECT_TRUE(vocab->matchable(100));
  // The structure tokens read as bytes no text can spell: 0xFF is never in a
  // matchable base token.
  for (int i = 0; i < kNumStructureTokens; ++i) {
    EXPECT_EQ(vocab->token_bytes(kStructureTokenIds[i]), StructureTokenBytes(i));
  }
  EXPECT_EQ(kStructureTokenIds[0], tokenizer::kOpenId);
  for (int32_t id = 0; id < tokenizer::kNumBaseTokens; ++id) {
    ASSERT_EQ(vocab->token_bytes(id).find('\xFF'), std::string::npos) << id;
  }
}

// kToolCalls: the structure tokens are allowed exactly where the markup has
// them (never in a text grammar: the masks of StopTokensOnlyWhenComplete), the
// index is the call's, the arguments follow the alternative's schema, and the
// grammar ends (stop tokens) only after the final end.
TEST(GrammarTest, ToolCallsMaskTheMarkupAndEachCallsArguments) {
  const std::string source = R"({"calls":[
      {"begin":"<|open|>call tool=\"a\" index=\"{index}\"<|sep|>","end":"<|close|>call<|sep|>",
       "parameters":{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":9}},
                     "required":["n"],"additionalProperties":false}},
      {"begin":"<|open|>call tool=\"b\" index=\"{index}\"<|sep|>","end":"<|close|>call<|sep|>"}],
    "end":"<|close|>tools<|sep|>","max_calls":2})";
  auto g = MustCompile(ConstraintSpec::Kind::kToolCalls, source);
  ASSERT_NE(g, nullptr);
  const std::string open = StructureTokenBytes(0), sep = StructureTokenBytes(1),
                    close = StructureTokenBytes(2);
  GrammarMatcher m(g);
  std::vector<uint32_t> mask(g->vocab().bitmask_words());
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  int allowed = 0;
  for (int32_t id = 0; id < g->vocab().size(); ++id) allowed += Bit(mask, id);
  EXPECT_EQ(allowed, 1);  // <|open|> only
  EXPECT_TRUE(Bit(mask, tokenizer::kOpenId));
  ASSERT_TRUE(m.AcceptToken(tokenizer::kOpenId));
  EXPECT_FALSE(m.AcceptBytes("call tool=\"c\""));              // not a declared tool
  EXPECT_FALSE(m.AcceptBytes("call tool=\"a\" index=\"2\""));  // call 1
  ASSERT_TRUE(m.AcceptBytes("call tool=\"a\" index=\"1\""));
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_TRUE(Bit(mask, tokenizer::kSepId));
  EXPECT_FALSE(Bit(mask, tokenizer::kCloseId));
  ASSERT_TRUE(m.AcceptToken(tokenizer::kSepId));
  EXPECT_FALSE(m.AcceptBytes("{\"n\": 12"));  // maximum 9
  ASSERT_TRUE(m.AcceptBytes("{\"n\": 7}"));
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_TRUE(Bit(mask, tokenizer::kCloseId));
  EXPECT_FALSE(Bit(mask, tokenizer::kEosId));
  ASSERT_TRUE(m.AcceptBytes(close + "call" + sep));
  // Another call (index 2, tool b: any object) or the end.
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_TRUE(Bit(mask, tokenizer::kOpenId));
  EXPECT_TRUE(Bit(mask, tokenizer::kCloseId));
  EXPECT_FALSE(Bit(mask, tokenizer::kEosId));
  ASSERT_TRUE(m.AcceptBytes(open + "call tool=\"b\" index=\"2\"" + sep +
                            "{\"x\": [1, \"y\"]}" + close + "call" + sep));
  // max_calls 2: only the end now.
  EXPECT_FALSE(m.AcceptBytes(open));
  ASSERT_TRUE(m.AcceptBytes(close + "tools" + sep));
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_TRUE(Bit(mask, tokenizer::kEosId));
  EXPECT_TRUE(m.CanTerminate());
}

TEST(GrammarTest, ToolCallsSourceErrorsNameTheField) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kToolCalls;
  for (
      const auto& [src, want] : std::vector<std::pair<std::string, std::string>>{
          {"[]", "not a JSON object"},
          {R"({"calls":[],"end":""})", "calls must be a non-empty array"},
          {R"({"calls":[{"begin":"x","end":"y"}]})", "source.end"},
          {R"({"calls":[{"end":"y"}],"end":""})", "calls[0].begin"},
          {R"({"calls":[{"begin":"x","end":"y"}],"end":"","max_calls":0})",
           "max_calls"},
          {R"({"calls":[{"begin":"x","end":"y","parameters":{"type":"object","not":{}}}],)"
           R"("end":""})",
           "calls[0].parameters"}}) {
    spec.source = src;
    auto g = Compiler().Compile(spec);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << src;
    EXPECT_THAT(std::string(g.status().message()), ::testing::HasSubstr(want)) << src;
  }
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

TEST(GrammarTest, EbnfWalksStayInTheLanguage) {
  auto g = MustCompile(ConstraintSpec::Kind::kEbnf, R"g(
# balanced lists of small numbers
root ::= list
list ::= "[" (item ("," item)*)? "]"
item ::= [0-9]{1,2} | list
)g");
  ASSERT_NE(g, nullptr);
  for (uint32_t seed = 0; seed < 4; ++seed) {
    bool done = false;
    std::string out = RandomWalk(g, seed, 80, seed == 0 ? 4 : 0, &done);
    if (!done) continue;
    int depth = 0;
    for (char c : out) {
      depth += c == '[' ? 1 : c == ']' ? -1 : 0;
      EXPECT_GE(depth, 0) << out;
    }
    EXPECT_EQ(depth, 0) << out;
    EXPECT_TRUE(RE2::FullMatch(out, R"([\[\],0-9]+)")) << out;
  }
}

TEST(GrammarTest, RollbackRestoresTheState) {
  auto g = MustCompile(ConstraintSpec::Kind::kRegex, "abc(d|e)f");
  ASSERT_NE(g, nullptr);
  auto t = tokenizer::Tokenizer::Load(kModelDir);
  ASSERT_TRUE(t.ok());
  auto ids = (*t)->Encode("abcdf");
  ASSERT_TRUE(ids.ok());
  GrammarMatcher m(g, /*max_rollback_tokens=*/4);
  std::vector<uint32_t> before(g->vocab().bitmask_words()), after(before.size());
  m.FillNextTokenBitmask(absl::MakeSpan(before));
  for (int id : *ids) ASSERT_TRUE(m.AcceptToken(id));
  EXPECT_TRUE(m.CanTerminate());
  EXPECT_FALSE(m.AcceptToken((*ids)[0]));  // nothing may follow
  ASSERT_TRUE(m.AcceptToken(tokenizer::kEosId));
  EXPECT_TRUE(m.IsTerminated());
  ASSERT_TRUE(m.Rollback(static_cast<int>(ids->size()) + 1).ok());
  EXPECT_FALSE(m.IsTerminated());
  m.FillNextTokenBitmask(absl::MakeSpan(after));
  EXPECT_EQ(before, after);
  EXPECT_FALSE(m.Rollback(1).ok());  // nothing left to undo
  EXPECT_EQ(m.Rollback(-1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GrammarTest, StopTokensOnlyWhenComplete) {
  auto g = MustCompile(ConstraintSpec::Kind::kJsonSchema,
                       R"({"type": "integer", "minimum": 0, "maximum": 99})");
  ASSERT_NE(g, nullptr);
  GrammarMatcher m(g);
  std::vector<uint32_t> mask(g->vocab().bitmask_words());
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_FALSE(Bit(mask, tokenizer::kEosId));
  EXPECT_FALSE(Bit(mask, tokenizer::kOpenId));
  ASSERT_TRUE(m.AcceptBytes("4"));
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  EXPECT_TRUE(Bit(mask, tokenizer::kEosId));
  EXPECT_TRUE(Bit(mask, tokenizer::kEndOfMsgId));
  EXPECT_FALSE(Bit(mask, tokenizer::kOpenId));
  ASSERT_TRUE(m.AcceptBytes("2"));
  EXPECT_FALSE(m.AcceptBytes("0"));  // 420 > 99
  m.FillNextTokenBitmask(absl::MakeSpan(mask));
  int allowed = 0;
  for (int32_t id = 0; id < g->vocab().size(); ++id) allowed += Bit(mask, id);
  EXPECT_EQ(allowed, 2);  // only the two stop tokens
}

TEST(GrammarTest, JumpForwardFindsForcedBytes) {
  auto g = MustCompile(
      ConstraintSpec::Kind::kJsonSchema,
      R"({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false})");
  ASSERT_NE(g, nullptr);
  CompileLimits limits;
  GrammarMatcher m(g);
  ASSERT_TRUE(m.AcceptBytes("{"));
  // Whitespace may come first, so nothing is forced yet; after the key's
  // quote the rest of the key is.
  ASSERT_TRUE(m.AcceptBytes("\""));
  EXPECT_EQ(m.FindJumpForwardString(), "name\"");
}

TEST(GrammarTest, CompilerCachesBySpec) {
  GrammarCompiler compiler(K3Vocab());
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kRegex;
  spec.source = "[0-9]+";
  auto a = compiler.Compile(spec);
  auto b = compiler.Compile(spec);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(compiler.cache_hits(), 1);
  spec.kind = ConstraintSpec::Kind::kEbnf;  // same text, other kind: a miss
  spec.source = "root ::= [0-9]+";
  auto c = compiler.Compile(spec);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->get(), c->get());
}

struct ErrorCase {
  ConstraintSpec::Kind kind;
  std::string source;
  absl::StatusCode code;
  std::string needle;
};

TEST(GrammarTest, ErrorsNameTheProblem) {
  using K = ConstraintSpec::Kind;
  const std::vector<ErrorCase> cases = {
      {K::kJsonSchema, R"({"type": "string", "contentSchema": {}})",
       absl::StatusCode::kInvalidArgument, "contentSchema"},
      {K::kJsonSchema, R"({"type": "number", "multipleOf": 3})",
       absl::StatusCode::kInvalidArgument, "multipleOf"},
      {K::kJsonSchema, R"({"not": {"type": "string"}})",
       absl::StatusCode::kInvalidArgument, "'not'"},
      {K::kJsonSchema, R"({"type": "array", "uniqueItems": true})",
       absl::StatusCode::kInvalidArgument, "uniqueItems"},
      {K::kJsonSchema, R"({"type": "object", "patternProperties": {"a": {}}})",
       absl::StatusCode::kInvalidArgument, "patternProperties"},
      {K::kJsonSchema, R"({"type": "string", "format": "hostname"})",
       absl::StatusCode::kInvalidArgument, "hostname"},
      {K::kJsonSchema, R"j({"type": "string", "pattern": "(?=x)"})j",
       absl::StatusCode::kInvalidArgument, "lookaround"},
      {K::kJsonSchema, R"({"$ref": "https://example.com/s.json"})",
       absl::StatusCode::kInvalidArgument, "remote"},
      {K::kJsonSchema, R"({"$ref": "#/$defs/missing"})",
       absl::StatusCode::kInvalidArgument, "does not resolve"},
      {K::kJsonSchema, R"({"allOf": [{"type": "string"}, {"type": "integer"}]})",
       absl::StatusCode::kInvalidArgument, "do not intersect"},
      {K::kJsonSchema, R"({"type": "integer", "minimum": 5, "maximum": 4})",
       absl::StatusCode::kInvalidArgument, "no integer"},
      {K::kJsonSchema, R"({"type": "strng"})", absl::StatusCode::kInvalidArgument,
       "strng"},
      {K::kJsonSchema, R"({"type": )", absl::StatusCode::kInvalidArgument,
       "not valid JSON"},
      {K::kJsonSchema,
       R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})",
       absl::StatusCode::kInvalidArgument, "no output"},
      {K::kEbnf, "root ::= item\n", absl::StatusCode::kInvalidArgument,
       "'item' is used but not defined"},
      {K::kEbnf, "start ::= \"a\"", absl::StatusCode::kInvalidArgument, "no 'root'"},
      {K::kEbnf, "root ::= \"a", absl::StatusCode::kInvalidArgument, "line 1"},
      {K::kEbnf, "root ::= root \"a\" | \"b\"", absl::StatusCode::kInvalidArgument,
       "left recursion"},
      {K::kRegex, "a(b", absl::StatusCode::kInvalidArgument, "offset"},
      {K::kRegex, "(a)\\1", absl::StatusCode::kInvalidArgument, "backreferences"},
  };
  for (const ErrorCase& c : cases) {
    ConstraintSpec spec;
    spec.kind = c.kind;
    spec.source = c.source;
    auto g = Compiler().Compile(spec);
    ASSERT_FALSE(g.ok()) << c.source;
    EXPECT_EQ(g.status().code(), c.code) << c.source << ": " << g.status();
    EXPECT_NE(g.status().message().find(c.needle), std::string::npos)
        << c.source << ": " << g.status();
  }
  ConstraintSpec empty_choice;
  empty_choice.kind = ConstraintSpec::Kind::kChoice;
  EXPECT_EQ(Compiler().Compile(empty_choice).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GrammarTest, BudgetsAreResourceExhausted) {
  CompileLimits limits;
  limits.max_nesting_depth = 8;
  limits.max_automaton_states = 20000;
  limits.max_source_bytes = 4096;
  GrammarCompiler compiler(K3Vocab(), limits);
  std::string deep = "{\"type\": \"string\"}";
  for (int i = 0; i < 12; ++i) deep = "{\"type\": \"array\", \"items\": " + deep + "}";
  std::string big =
      R"({"type": "array", "items": {"type": "string", "format": "date-time"}, "minItems": 900, "maxItems": 900})";
  std::string huge(5000, ' ');
  huge += "{}";
  for (const std::string& src : {deep, big, huge}) {
    ConstraintSpec spec;
    spec.kind = ConstraintSpec::Kind::kJsonSchema;
    spec.source = src;
    auto g = compiler.Compile(spec);
    ASSERT_FALSE(g.ok()) << src.substr(0, 80);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted) << g.status();
  }
  CompileLimits fast;
  fast.max_compile_time = absl::ZeroDuration();
  GrammarCompiler timed(K3Vocab(), fast);
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kJsonSchema;
  spec.source =
      R"({"type": "object", "properties": {"a": {"type": "string", "maxLength": 300}}})";
  EXPECT_EQ(timed.Compile(spec).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(GrammarTest, ApplyTokenBitmaskMasksLogits) {
  std::vector<uint32_t> mask = {0b1010};
  std::vector<float> logits = {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
                               12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                               23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33};
  ApplyTokenBitmask(mask, absl::MakeSpan(logits));
  EXPECT_EQ(logits[1], 2);
  EXPECT_EQ(logits[3], 4);
  EXPECT_TRUE(std::isinf(logits[0]) && logits[0] < 0);
  EXPECT_TRUE(std::isinf(logits[2]));
  EXPECT_TRUE(std::isinf(logits[32]));  // past the bitmask
}

}  // namespace
}  // namespace tandem::grammar

namespace tandem::grammar {
namespace {

// The sorted arena and next_shorter() that the mask walk skips decided
// subtrees with, against their definitions on the real vocabulary.
TEST(TokenVocabularyTest, SortedArenaAndNextShorterMatchTheirDefinitions) {
  const TokenVocabulary& v = *K3Vocab();
  const std::vector<int32_t>& sorted = v.sorted_ids();
  const std::vector<int32_t>& lcp = v.lcp();
  const std::vector<int32_t>& ns = v.next_shorter();
  const int32_t n = static_cast<int32_t>(sorted.size());
  ASSERT_EQ(ns.size(), sorted.size());
  for (int32_t i = 0; i < n; ++i) {
    ASSERT_EQ(v.sorted_token(i), v.token_bytes(sorted[i])) << i;
    if (i > 0) ASSERT_LT(v.sorted_token(i - 1), v.sorted_token(i)) << i;
  }
  std::mt19937 rng(5);
  for (int k = 0; k < 3000; ++k) {
    const int32_t i = static_cast<int32_t>(rng() % n);
    int32_t want = i + 1;
    while (want < n && lcp[want] >= lcp[i]) ++want;
    ASSERT_EQ(ns[i], want) << i;
    // The run of tokens sharing token i's first L bytes, by hops and by scan.
    const int32_t len = static_cast<int32_t>(v.sorted_token(i).size());
    const int32_t L = 1 + static_cast<int32_t>(rng() % len);
    int32_t hop = i + 1;
    while (hop < n && lcp[hop] >= L) hop = ns[hop];
    int32_t scan = i + 1;
    while (scan < n &&
           v.sorted_token(scan).substr(0, L) == v.sorted_token(i).substr(0, L)) {
      ++scan;
    }
    ASSERT_EQ(hop, scan) << i << " L=" << L;
  }
}

}  // namespace
}  // namespace tandem::grammar

namespace tandem::grammar {
namespace {

// PrecomputeMasks fills every entry a non-recursive schema's walks can need
// (a walk afterwards computes nothing new), the entries are the lazily
// computed ones (brute-force checked masks), and slices resume where the last
// one stopped.
TEST(MaskPrecomputeTest, EveryNeededEntryAheadAndResumable) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kJsonSchema;
  spec.source = R"({"type":"object","properties":{
      "name":{"type":"string","maxLength":8},
      "n":{"type":"integer","minimum":0,"maximum":99},
      "tags":{"type":"array","items":{"enum":["x","yz"]},"maxItems":2}},
      "required":["name","n"],"additionalProperties":false})";
  GrammarCompiler whole(K3Vocab(), CompileLimits());
  auto g = whole.Compile(spec);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE((*g)->mask_cache().precomputed());
  EXPECT_FALSE((*g)->PrecomputeMasks(absl::InfinitePast()));  // deadline passed
  EXPECT_EQ((*g)->mask_cache().computed_entries(), 0);
  ASSERT_TRUE((*g)->PrecomputeMasks(absl::InfiniteFuture()));
  EXPECT_TRUE((*g)->mask_cache().precomputed());
  const int64_t all = (*g)->mask_cache().computed_entries();
  EXPECT_GT(all, 10);
  for (uint32_t seed = 0; seed < 4; ++seed) {
    bool done = false;
    RandomWalk(*g, seed, 40, seed == 0 ? 5 : 0, &done);
  }
  EXPECT_EQ((*g)->mask_cache().computed_entries(), all);

  // The same in 1 ms slices on a fresh compile: the same entries in the end.
  GrammarCompiler sliced(K3Vocab(), CompileLimits());
  auto h = sliced.Compile(spec);
  ASSERT_TRUE(h.ok()) << h.status();
  int slices = 0;
  while (!(*h)->PrecomputeMasks(absl::Now() + absl::Milliseconds(1))) ++slices;
  EXPECT_GT(slices, 0);
  EXPECT_EQ((*h)->mask_cache().computed_entries(), all);
}

}  // namespace
}  // namespace tandem::grammar
