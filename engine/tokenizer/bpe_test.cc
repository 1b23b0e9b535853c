#include "engine/tokenizer/bpe.h"

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::tokenizer {
namespace {

// The plain tiktoken loop, written independently of bpe.cc: a list of parts,
// merge the leftmost lowest-ranked adjacent pair until none has a rank.
std::vector<int> ReferenceMerge(const BytePairEncoder& bpe, const std::string& piece) {
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  while (parts.size() > 1) {
    int best = std::numeric_limits<int>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const int r = bpe.Rank(parts[i] + parts[i + 1]);
      if (r >= 0 && r < best) {
        best = r;
        at = i;
      }
    }
    if (best == std::numeric_limits<int>::max()) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + at + 1);
  }
  std::vector<int> ids;
  for (const std::string& p : parts) ids.push_back(bpe.Rank(p));
  return ids;
}

// A model of the 256 bytes (rank = byte) plus `extra` tokens from rank 256.
std::string SyntheticModel(const std::vector<std::string>& extra) {
  std::string out;
  for (int b = 0; b < 256; ++b) {
    absl::StrAppend(&out, absl::Base64Escape(std::string(1, static_cast<char>(b))), " ",
                    b, "\n");
  }
  for (size_t i = 0; i < extra.size(); ++i) {
    absl::StrAppend(&out, absl::Base64Escape(extra[i]), " ", 256 + i, "\n");
  }
  return out;
}

TEST(BpeTest, MergeOrderOnSyntheticRanks) {
  auto bpe =
      BytePairEncoder::Parse(SyntheticModel({"ab", "bc", "abc", "aa"}), 260, "m");
  ASSERT_TRUE(bpe.ok()) << bpe.status();
  std::vector<int> ids;
  bpe->Encode("abcd", &ids);  // ab (256) first, then abc (258)
  EXPECT_EQ(ids, (std::vector<int>{258, 'd'}));
  ids.clear();
  bpe->Encode("aaa", &ids);  // tie between the two "aa": leftmost wins
  EXPECT_EQ(ids, (std::vector<int>{259, 'a'}));
  ids.clear();
  bpe->Encode("xbc", &ids);
  EXPECT_EQ(ids, (std::vector<int>{'x', 257}));
}

TEST(BpeTest, RealModel) {
  auto bpe =
      BytePairEncoder::Load("third_party/kimi_k3_tokenizer/tiktoken.model", 163584);
  ASSERT_TRUE(bpe.ok()) << bpe.status();
  EXPECT_EQ(bpe->size(), 163584);
  EXPECT_EQ(bpe->Rank("Hello"), 19180);
  EXPECT_EQ(bpe->Bytes(19180), "Hello");
  EXPECT_EQ(bpe->Rank("!"), 0);
  EXPECT_EQ(bpe->Rank("not a token at all, surely"), -1);
  // Random pieces, short (quadratic path) and long (heap path), built from
  // text fragments and raw bytes, against the reference loop.
  const std::vector<std::string> fragments = {
      "the", " ",  "ing", "中", "文", "😀", "\xE4", "\xFF", "aa", "  ",
      "\n",  "'s", "0",   "12", "ab", "Ж", "é",    "!",    "==", "\t"};
  std::mt19937 rng(11);
  for (int iter = 0; iter < 400; ++iter) {
    std::string piece;
    const size_t target = 1 + rng() % (iter % 2 ? 40 : 600);
    while (piece.size() < target) piece += fragments[rng() % fragments.size()];
    std::vector<int> ids;
    bpe->Encode(piece, &ids);
    ASSERT_EQ(ids, ReferenceMerge(*bpe, piece)) << absl::CHexEscape(piece);
  }
  // Long runs of one byte (the 25,000-character chunks of upstream).
  for (const std::string& piece : {std::string(3000, ' '), std::string(2001, 'a')}) {
    std::vector<int> ids;
    bpe->Encode(piece, &ids);
    ASSERT_EQ(ids, ReferenceMerge(*bpe, piece));
  }
}

struct BadModelCase {
  std::string name;
  std::string contents;
  std::string expected_message;
};

TEST(BpeTest, MalformedModelsGiveClearErrors) {
  const std::string good = SyntheticModel({"ab"});
  const std::vector<BadModelCase> cases = {
      {"no_space", good + "YWJj\n", "m:258: expected 'base64-token rank'"},
      {"extra_field", good + "YWJj 257 9\n", "m:258: expected 'base64-token rank'"},
      {"bad_base64", good + "!!!! 257\n", "m:258: bad base64 token"},
      {"bad_rank", good + "YWJj x7\n", "m:258: bad rank 'x7'"},
      {"rank_range", good + "YWJj 999\n", "m:258: rank 999 outside [0, 258)"},
      {"dup_rank", good + "YWJj 256\n", "m:258: duplicate rank 256"},
      {"dup_token", good + "YWI= 257\n", "token 'ab' has two ranks, 256 and 257"},
      {"count", SyntheticModel({}), "expected 258 ranks, found 256"},
  };
  for (const BadModelCase& c : cases) {
    const int count = 258;  // 256 bytes + "ab" + one more
    auto bpe = BytePairEncoder::Parse(c.contents, count, "m");
    ASSERT_FALSE(bpe.ok()) << c.name;
    EXPECT_EQ(bpe.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(bpe.status().message().find(c.expected_message), std::string::npos)
        << c.name << ": " << bpe.status();
  }
  // All 256 bytes are required.
  std::string missing_byte;
  for (int b = 1; b < 256; ++b) {
    absl::StrAppend(&missing_byte,
                    absl::Base64Escape(std::string(1, static_cast<char>(b))), " ",
                    b - 1, "\n");
  }
  auto bpe = BytePairEncoder::Parse(missing_byte, 255, "m");
  ASSERT_FALSE(bpe.ok());
  EXPECT_NE(bpe.status().message().find("byte 0x0 has no rank"), std::string::npos)
      << bpe.status();
  // Missing file.
  auto missing = BytePairEncoder::Load("/nonexistent/tiktoken.model", 10);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/tiktoken.model"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem::tokenizer
