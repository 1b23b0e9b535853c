#include "engine/tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/tokenizer/utf8.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

constexpr char kModelDir[] = "third_party/kimi_k3_tokenizer";

const Tokenizer& K3() {
  static const Tokenizer* const tok = [] {
    auto t = Tokenizer::Load(kModelDir);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  return *tok;
}

std::vector<std::string> CorpusTexts() {
  std::ifstream in("tests/data/tokenizer/corpus.jsonl");
  EXPECT_TRUE(in);
  std::vector<std::string> texts;
  std::string line;
  while (std::getline(in, line)) texts.push_back(nlohmann::json::parse(line)["text"]);
  return texts;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<int> Concat(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int> Enc(absl::string_view text) {
  auto ids = K3().Encode(text);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int>{};
}

TEST(TokenizerTest, PublishedVector) {
  EXPECT_EQ(Enc("Hello, world! 你好，世界！"),
            (std::vector<int>{19180, 11, 2695, 0, 220, 33845, 378, 2243, 856}));
  EXPECT_EQ(Enc(""), std::vector<int>{});
}

TEST(TokenizerTest, VocabularyAndSpecialIds) {
  const Tokenizer& t = K3();
  EXPECT_EQ(t.vocab_size(), 163840);
  EXPECT_EQ(t.bos_id(), 163584);
  EXPECT_EQ(t.eos_id(), 163585);
  EXPECT_EQ(t.stop_ids(), (std::vector<int>{163585, 163586}));
  const std::vector<std::pair<int, std::string>> named = {
      {kBosId, "[BOS]"},
      {kEosId, "[EOS]"},
      {kEndOfMsgId, "<|end_of_msg|>"},
      {kOpenId, "<|open|>"},
      {kCloseId, "<|close|>"},
      {kSepId, "<|sep|>"},
      {163602, "<|media_begin|>"},
      {kUnkId, "[UNK]"},
      {kPadId, "[PAD]"}};
  for (const auto& [id, name] : named) {
    EXPECT_EQ(*t.IdToken(id), name);
    EXPECT_EQ(*t.TokenId(name), id);
  }
  // Unnamed slots are named after their id, as tokenization_kimi.py does.
  EXPECT_EQ(*t.IdToken(163592), "<|reserved_token_163592|>");
  EXPECT_EQ(*t.TokenId("<|reserved_token_163700|>"), 163700);
  EXPECT_FALSE(t.TokenId("<|reserved_token_5|>").ok());
  EXPECT_EQ(*t.IdToken(19180), "Hello");
  EXPECT_EQ(*t.TokenId("Hello"), 19180);
  EXPECT_EQ(t.IdToken(163840).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.IdToken(-1).status().code(), absl::StatusCode::kInvalidArgument);
  // The config's "special" flag: XTML structure tokens are not special.
  EXPECT_TRUE(t.IsSpecial(kBosId));
  EXPECT_TRUE(t.IsSpecial(kEndOfMsgId));
  EXPECT_FALSE(t.IsSpecial(kOpenId));
  EXPECT_FALSE(t.IsSpecial(kCloseId));
  EXPECT_FALSE(t.IsSpecial(kSepId));
  EXPECT_TRUE(t.IsSpecial(163700));  // reserved
  EXPECT_FALSE(t.IsSpecial(19180));
  EXPECT_EQ(t.AllSpecialTokens().size(), 256u);
}

TEST(TokenizerTest, SpecialSpellingsAreOrdinaryText) {
  for (const char* s : {"<|open|>", "[EOS]", "<|end_of_msg|>", "[BOS]",
                        "<|reserved_token_163600|>", "x<|sep|>y"}) {
    const std::vector<int> ids = Enc(s);
    ASSERT_GT(ids.size(), 1u) << s;
    for (int id : ids) EXPECT_LT(id, kNumBaseTokens) << s;
    EXPECT_EQ(*K3().Decode(ids), s);
  }
}

TEST(TokenizerTest, EncodeWithSpecial) {
  const Tokenizer& t = K3();
  auto ids = t.EncodeWithSpecial("a<|open|>b [EOS]", {"<|open|>", "[EOS]"});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, Concat(Concat(Concat(Enc("a"), {kOpenId}), Enc("b ")), {kEosId}));
  // Only the allowed ones are special.
  ids = t.EncodeWithSpecial("a<|open|>b [EOS]", {"[EOS]"});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, Concat(Enc("a<|open|>b "), {kEosId}));
  ids = t.EncodeWithSpecial("[EOS][EOS]", t.AllSpecialTokens());
  EXPECT_EQ(*ids, (std::vector<int>{kEosId, kEosId}));
  EXPECT_FALSE(t.EncodeWithSpecial("x", {"<|nope|>"}).ok());
  EXPECT_EQ(*t.EncodeWithSpecial("a<|open|>", {}), Enc("a<|open|>"));
}

TEST(TokenizerTest, DecodeRoundTripsCorpus) {
  int n = 0;
  for (const std::string& text : CorpusTexts()) {
    const std::vector<int> ids = Enc(text);
    auto back = K3().Decode(ids);
    ASSERT_TRUE(back.ok());
    ASSERT_EQ(*back, text);
    ++n;
  }
  EXPECT_GT(n, 300);
}

TEST(TokenizerTest, Decode) {
  const Tokenizer& t = K3();
  EXPECT_EQ(t.Decode({163590}).status().code(), absl::StatusCode::kOk);
  EXPECT_EQ(t.Decode({1, 163840}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Decode({-5}).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<int> ids = Concat(Concat({kBosId}, Enc("hi")), {kOpenId, kEosId});
  EXPECT_EQ(*t.Decode(ids), "[BOS]hi<|open|>[EOS]");
  EXPECT_EQ(*t.Decode(ids, /*skip_special_tokens=*/true), "hi<|open|>");
  // A lone byte token decodes to that byte (not valid UTF-8 on its own).
  EXPECT_EQ(*t.Decode({*t.TokenId("\xE4")}), "\xE4");
}

TEST(TokenizerTest, LongRunChunking) {
  // Upstream encodes runs longer than 25,000 characters in separate pieces.
  const std::string a25k(25000, 'a');
  EXPECT_EQ(Enc(a25k + "a"), Concat(Enc(a25k), Enc("a")));
  const std::string s25k(25000, ' ');
  EXPECT_EQ(Enc(s25k + "  x"), Concat(Enc(s25k), Enc("  x")));
  // 400,000-code-point slices: "ab " * n never reaches the run limit.
  std::string big;
  while (big.size() < 400000) big += "ab ";
  big.resize(400000);
  EXPECT_EQ(Enc(big + "cd"), Concat(Enc(big), Enc("cd")));
  // Without chunking " cd" would be one piece after "ab": check it matters.
  EXPECT_NE(Enc(big.substr(0, 399999) + " cd"),
            Concat(Enc(big.substr(0, 399999)), Enc(" cd")));
  // A long Han run (one 75 KB piece) round-trips.
  std::string han;
  for (int i = 0; i < 12000; ++i) han += "中文";
  EXPECT_EQ(*K3().Decode(Enc(han)), han);
}

TEST(TokenizerTest, RejectsInvalidUtf8) {
  EXPECT_EQ(K3().Encode("ab\xFF").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerTest, LoadErrors) {
  auto missing = Tokenizer::Load("/nonexistent/dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/tiktoken.model"),
            std::string::npos);

  const std::string model = ReadFile(std::string(kModelDir) + "/tiktoken.model");
  const std::string config =
      ReadFile(std::string(kModelDir) + "/tokenizer_config.json");
  ASSERT_TRUE(Tokenizer::FromContents(model, config).ok());
  // Wrong count: drop the last line.
  const std::string short_model =
      model.substr(0, model.rfind('\n', model.size() - 2) + 1);
  auto t = Tokenizer::FromContents(short_model, config);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("expected 163584 ranks, found 163583"),
            std::string::npos)
      << t.status();
  // Malformed line.
  t = Tokenizer::FromContents("IQ== 0\nnot-a-line\n", config);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tiktoken.model:2"), std::string::npos)
      << t.status();
  // Config problems.
  t = Tokenizer::FromContents(model, "{not json");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  t = Tokenizer::FromContents(model,
                              R"({"added_tokens_decoder": {"5": {"content": "x"}}})");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("added token id 5 outside"), std::string::npos);
  t = Tokenizer::FromContents(model,
                              R"({"added_tokens_decoder": {"163584": {"content": "[A]"},
                                          "163585": {"content": "[A]"}}})");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("used by ids 163584 and 163585"),
            std::string::npos);
  t = Tokenizer::FromContents(model, R"({"other": 1})");
  EXPECT_NE(t.status().message().find("added_tokens_decoder"), std::string::npos);
}

}  // namespace
}  // namespace tandem::tokenizer
