#include "engine/tokenizer/incremental_detokenizer.h"

#include <fstream>
#include <string>
#include <vector>

#include "engine/tokenizer/utf8.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

const Tokenizer& K3() {
  static const Tokenizer* const tok = [] {
    auto t = Tokenizer::Load("third_party/kimi_k3_tokenizer");
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

// Streams `ids`; checks every delta is valid UTF-8 and returns them joined.
std::string Stream(const std::vector<int>& ids, IncrementalDetokenizer::Options options,
                   int* empty_deltas = nullptr) {
  IncrementalDetokenizer detok(&K3(), options);
  std::string all;
  for (int id : ids) {
    auto delta = detok.Add(id);
    EXPECT_TRUE(delta.ok());
    EXPECT_TRUE(IsValidUtf8(*delta));
    EXPECT_LE(detok.pending_bytes(), 3u);
    if (empty_deltas && delta->empty()) ++*empty_deltas;
    all += *delta;
  }
  const std::string tail = detok.Flush();
  EXPECT_TRUE(IsValidUtf8(tail));
  return all + tail;
}

TEST(IncrementalDetokenizerTest, CharactersSplitAcrossTokens) {
  // Find real cases in the corpus: a token whose bytes are not valid UTF-8 on
  // their own (part of a CJK character or emoji spread over several tokens).
  int split_tokens = 0;
  for (const std::string& text : CorpusTexts()) {
    const std::vector<int> ids = *K3().Encode(text);
    for (int id : ids) {
      if (!IsValidUtf8(*K3().IdToken(id))) ++split_tokens;
    }
    int empty = 0;
    ASSERT_EQ(Stream(ids, {}, &empty), text);
  }
  EXPECT_GT(split_tokens, 20);
}

TEST(IncrementalDetokenizerTest, HoldsBackAnIncompleteCharacter) {
  // 𪚥 (U+2A6A5, four bytes) is not one token: its first token is an
  // incomplete sequence, so the first delta must be empty.
  const std::string ch = "\xF0\xAA\x9A\xA5";
  const std::vector<int> ids = *K3().Encode(ch);
  ASSERT_GT(ids.size(), 1u);
  ASSERT_FALSE(IsValidUtf8(*K3().IdToken(ids[0])));
  IncrementalDetokenizer detok(&K3());
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string delta = *detok.Add(ids[i]);
    if (i + 1 < ids.size()) {
      EXPECT_EQ(delta, "") << i;
    } else {
      EXPECT_EQ(delta, ch);
    }
  }
  EXPECT_EQ(detok.Flush(), "");
}

TEST(IncrementalDetokenizerTest, InvalidBytesBecomeReplacementChars) {
  const Tokenizer& t = K3();
  const int e4 = *t.TokenId("\xE4");
  const int ff = *t.TokenId("\xFF");
  const int a = *t.TokenId("a");
  IncrementalDetokenizer detok(&t);
  EXPECT_EQ(*detok.Add(e4), "");  // could still become a character
  EXPECT_EQ(detok.pending_bytes(), 1u);
  EXPECT_EQ(*detok.Add(a),
            "\xEF\xBF\xBD"
            "a");                             // it cannot any more
  EXPECT_EQ(*detok.Add(ff), "\xEF\xBF\xBD");  // never valid
  EXPECT_EQ(*detok.Add(e4), "");
  EXPECT_EQ(detok.Flush(), "\xEF\xBF\xBD");  // unfinished at the end
  EXPECT_EQ(detok.pending_bytes(), 0u);
  // The joined deltas equal the replaced whole decode.
  const std::vector<int> ids = {e4, a, ff, e4};
  EXPECT_EQ(Stream(ids, {}), ReplaceInvalidUtf8(*t.Decode(ids)));
}

TEST(IncrementalDetokenizerTest, SkipSpecialTokens) {
  const Tokenizer& t = K3();
  std::vector<int> ids = {kBosId};
  const std::vector<int> text_ids = *t.Encode("héllo 世界");
  ids.insert(ids.end(), text_ids.begin(), text_ids.end());
  ids.push_back(kOpenId);
  ids.push_back(kEndOfMsgId);
  EXPECT_EQ(Stream(ids, {}), "[BOS]héllo 世界<|open|><|end_of_msg|>");
  EXPECT_EQ(Stream(ids, {.skip_special_tokens = true}), "héllo 世界<|open|>");
}

TEST(IncrementalDetokenizerTest, RejectsBadIdsWithoutLosingState) {
  IncrementalDetokenizer detok(&K3());
  const std::vector<int> ids = *K3().Encode("\xF0\xAA\x9A\xA5");
  ASSERT_EQ(*detok.Add(ids[0]), "");
  const size_t pending = detok.pending_bytes();
  EXPECT_EQ(detok.Add(163840).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(detok.Add(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(detok.pending_bytes(), pending);
}

}  // namespace
}  // namespace tandem::tokenizer
