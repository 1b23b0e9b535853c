// Every corpus schema compiles, and seeded random walks that sample only
// allowed tokens always produce JSON that parses and validates against the
// schema (checked by the independent testing_validator). The walks use the
// first 4096 K3 tokens (all single bytes and common merges) so that all 210
// schemas run in seconds; grammar_test covers the full 163,840 vocabulary.
#include "engine/grammar/schema_corpus.h"

#include <fstream>
#include <random>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/testing_validator.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::grammar {
namespace {

constexpr int kSubsetTokens = 4096;

std::shared_ptr<const TokenVocabulary> SubsetVocab() {
  static const auto* vocab = [] {
    auto t = tokenizer::Tokenizer::Load("third_party/kimi_k3_tokenizer");
    EXPECT_TRUE(t.ok()) << t.status();
    std::vector<std::string> bytes(kSubsetTokens + 1);
    for (int id = 0; id < kSubsetTokens; ++id) {
      EXPECT_TRUE((*t)->AppendTokenBytes(id, &bytes[id]).ok());
    }
    std::vector<int32_t> stops = {kSubsetTokens};
    auto v = TokenVocabulary::FromTokens(std::move(bytes), {}, stops);
    EXPECT_TRUE(v.ok()) << v.status();
    return new std::shared_ptr<const TokenVocabulary>(*v);
  }();
  return *vocab;
}

TEST(SchemaCorpusTest, CoversEveryFeatureWithUniqueNames) {
  const auto& corpus = SchemaCorpus();
  EXPECT_GE(corpus.size(), 200u);
  absl::flat_hash_set<std::string> names, features;
  for (const CorpusSchema& s : corpus) {
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    features.insert(s.feature);
    EXPECT_FALSE(nlohmann::json::parse(s.schema, nullptr, false).is_discarded())
        << s.name;
  }
  for (const char* f :
       {"type", "string_length", "format", "pattern", "integer_bounds", "number_bounds",
        "enum", "const", "object", "array", "anyOf", "oneOf", "allOf", "ref",
        "type_array", "nullable", "realistic", "random"}) {
    EXPECT_TRUE(features.contains(f)) << f;
  }
}

TEST(SchemaCorpusTest, TestdataFileIsCurrent) {
  std::ifstream in("engine/grammar/testdata/schema_corpus.jsonl");
  ASSERT_TRUE(in) << "regenerate with: bazel run //engine/grammar:dump_schema_corpus";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), SchemaCorpusJsonl())
      << "regenerate with: bazel run //engine/grammar:dump_schema_corpus";
}

TEST(SchemaCorpusTest, RandomWalksAlwaysValidate) {
  GrammarCompiler compiler(SubsetVocab());
  const TokenVocabulary& vocab = *SubsetVocab();
  std::vector<uint32_t> mask(vocab.bitmask_words());
  int finished = 0, walks = 0;
  for (const CorpusSchema& s : SchemaCorpus()) {
    ConstraintSpec spec;
    spec.kind = ConstraintSpec::Kind::kJsonSchema;
    spec.source = s.schema;
    auto g = compiler.Compile(spec);
    ASSERT_TRUE(g.ok()) << s.name << ": " << g.status();
    const nlohmann::json schema = nlohmann::json::parse(s.schema);
    for (uint32_t seed = 0; seed < 2; ++seed) {
      ++walks;
      GrammarMatcher m(*g);
      std::mt19937 rng(seed * 1000003 + std::hash<std::string>()(s.name) % 1000);
      std::string out;
      bool done = false;
      for (int step = 0; step < 400 && !done; ++step) {
        m.FillNextTokenBitmask(absl::MakeSpan(mask));
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab.size(); ++id) {
          if ((mask[id >> 5] >> (id & 31)) & 1) allowed.push_back(id);
        }
        ASSERT_FALSE(allowed.empty()) << s.name << " dead end after: " << out;
        int32_t pick = allowed[rng() % allowed.size()];
        // Past 200 tokens, end as soon as the grammar allows it.
        if (m.CanTerminate() && (step > 200 || rng() % 3 == 0)) pick = kSubsetTokens;
        ASSERT_TRUE(m.AcceptToken(pick)) << s.name;
        if (m.IsTerminated()) {
          done = true;
        } else {
          out += vocab.token_bytes(pick);
        }
      }
      if (!done) continue;  // ended by length: allowed, counted below
      ++finished;
      nlohmann::json value = nlohmann::json::parse(out, nullptr, false);
      ASSERT_FALSE(value.is_discarded()) << s.name << " produced invalid JSON: " << out;
      EXPECT_EQ(testing::Validate(schema, value), "")
          << s.name << " " << s.schema << "\n  -> " << out;
    }
  }
  // Most walks must reach a stop token within 400 tokens.
  EXPECT_GE(finished, walks * 8 / 10) << finished << " of " << walks;
}

}  // namespace
}  // namespace tandem::grammar
