#include "engine/speculative/ngram_proposer.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::speculative {
namespace {

struct Case {
  const char* name;
  std::vector<int32_t> tokens;
  NgramOptions options;
  int32_t k;
  std::vector<int32_t> want;
};

NgramOptions Opts(int32_t min_n, int32_t max_n, int64_t window = 0) {
  NgramOptions o;
  o.min_n = min_n;
  o.max_n = max_n;
  o.window = window;
  return o;
}

TEST(NgramLookupTest, Table) {
  const Case cases[] = {
      {"empty history", {}, Opts(1, 3), 4, {}},
      {"one token has nothing before it", {7}, Opts(1, 3), 4, {}},
      {"no match", {1, 2, 3, 4}, Opts(1, 3), 4, {}},
      {"unigram match", {5, 6, 7, 5}, Opts(1, 3), 2, {6, 7}},
      {"continuation capped by k", {5, 6, 7, 8, 9, 5}, Opts(1, 1), 3, {6, 7, 8}},
      {"continuation capped by the history end", {5, 6, 5}, Opts(1, 1), 4, {6, 5}},
      {"periodic text runs into the suffix", {1, 2, 1, 2, 1}, Opts(2, 2), 4, {2, 1}},
      // [2,3] occurs twice; the most recent occurrence (followed by 9) wins.
      {"most recent occurrence wins", {2, 3, 4, 2, 3, 9, 2, 3}, Opts(2, 2), 1, {9}},
      // The trigram [1,2,3] is followed by 4; the bigram [2,3] more recently by 8.
      {"longest n first", {1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3}, Opts(1, 3), 2, {4, 0}},
      {"min_n excludes short matches", {1, 2, 3, 9, 3}, Opts(2, 3), 2, {}},
      {"max_n beyond the history is clamped", {4, 4}, Opts(1, 8), 3, {4}},
      // The match at 0 lies outside the last 4 tokens.
      {"window hides old matches", {7, 1, 2, 3, 4, 7}, Opts(1, 1, 4), 2, {}},
      {"window keeps recent matches", {1, 2, 3, 7, 4, 7}, Opts(1, 1, 4), 2, {4, 7}},
      {"k zero proposes nothing", {5, 6, 5}, Opts(1, 1), 0, {}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(NgramLookup(c.tokens, c.options, c.k), c.want) << c.name;
  }
}

TEST(NgramLookupTest, DeterministicAndBounded) {
  std::vector<int32_t> tokens;
  uint32_t x = 12345;
  for (int i = 0; i < 2000; ++i) {
    x = x * 1664525u + 1013904223u;
    tokens.push_back((x >> 16) % 7);  // small alphabet: many matches
  }
  for (int k = 1; k <= 6; ++k) {
    for (int len = 2; len < 200; len += 13) {
      absl::Span<const int32_t> h(tokens.data(), len);
      auto a = NgramLookup(h, Opts(1, 4), k);
      EXPECT_EQ(a, NgramLookup(h, Opts(1, 4), k));
      EXPECT_LE(a.size(), static_cast<size_t>(k));
      // Every proposal is a substring of the history that follows an
      // occurrence of the history's last token.
      if (!a.empty()) {
        bool found = false;
        for (int i = 0; i + 1 < len && !found; ++i) {
          if (h[i] != h[len - 1]) continue;
          found = std::equal(a.begin(), a.end(), h.begin() + i + 1,
                             h.begin() + std::min<int>(len, i + 1 + a.size()));
        }
        EXPECT_TRUE(found) << "len " << len << " k " << k;
      }
    }
  }
}

TEST(NgramProposerTest, ProposesPerRequestAndValidatesOptions) {
  EXPECT_FALSE(NgramProposer::Create(Opts(0, 2)).ok());
  EXPECT_FALSE(NgramProposer::Create(Opts(3, 2)).ok());
  EXPECT_FALSE(NgramProposer::Create(Opts(1, 2, -1)).ok());
  auto p = NgramProposer::Create(Opts(1, 3));
  ASSERT_TRUE(p.ok());
  const std::vector<int32_t> a = {1, 2, 3, 1, 2};
  const std::vector<int32_t> b = {9, 8, 7};
  ProposeRequest ra, rb;
  ra.id = 1;
  ra.tokens = a;
  ra.max_drafts = 3;
  rb.id = 2;
  rb.tokens = b;
  rb.max_drafts = 3;
  std::vector<Proposal> out;
  ASSERT_TRUE((*p)->Propose({ra, rb}, &out).ok());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].tokens, (std::vector<int32_t>{3, 1, 2}));
  EXPECT_TRUE(out[0].probs.empty());  // deterministic drafts
  EXPECT_TRUE(out[1].tokens.empty());
}

}  // namespace
}  // namespace tandem::speculative
