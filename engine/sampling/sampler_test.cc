#include "engine/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kK3Vocab = 163840;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> LogitsFromProbs(const std::vector<double>& probs) {
  std::vector<float> out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

std::vector<float> RandomLogits(int64_t n, double scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<float> out(n);
  for (auto& v : out) v = static_cast<float>(d(rng));
  return out;
}

// Float64 log-softmax of x / t.
std::vector<double> RefLogSoftmax(const std::vector<float>& x, double t) {
  double m = -INFINITY;
  for (float v : x) m = std::max(m, v / t);
  double s = 0.0;
  for (float v : x) s += std::exp(v / t - m);
  std::vector<double> out;
  for (float v : x) out.push_back(v / t - m - std::log(s));
  return out;
}

// Reference truncation by a full sort in double: top-k, then top-p over the
// top-k-renormalised distribution, then min-p; returns the final distribution.
std::vector<double> RefDistribution(const std::vector<float>& logits, double t,
                                    int top_k, double top_p, double min_p) {
  const int64_t n = logits.size();
  std::vector<double> lp = RefLogSoftmax(logits, t);
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return lp[a] > lp[b]; });
  int64_t keep = n;
  if (top_k > 0 && top_k < n) keep = top_k;
  double zk = 0.0;
  for (int64_t i = 0; i < keep; ++i) zk += std::exp(lp[order[i]]);
  if (top_p < 1.0) {
    double acc = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      acc += std::exp(lp[order[i]]) / zk;
      if (acc >= top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  std::vector<double> out(n, 0.0);
  const double pmax = std::exp(lp[order[0]]);
  double z = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    const double p = std::exp(lp[order[i]]);
    if (p >= min_p * pmax) {
      out[order[i]] = p;
      z += p;
    }
  }
  for (double& p : out) p /= z;
  return out;
}

SampleRequest Request(const std::vector<float>& logits, const SamplingParams& params,
                      int64_t position = 0) {
  SampleRequest r;
  r.logits = logits;
  r.params = &params;
  r.position = position;
  return r;
}

TEST(SamplerTest, GreedyTakesArgmaxWithLowestIdOnTies) {
  Sampler sampler(6);
  const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f, 0.0f, 3.0f};
  SamplingParams p;
  auto r = sampler.Sample(Request(logits, p));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_id, 1);
  // Greedy needs no seed, and position does not matter.
  EXPECT_EQ(sampler.Sample(Request(logits, p, 99))->token_id, 1);
}

TEST(SamplerTest, PenaltiesMatchHandComputedLogits) {
  // prompt {2}; output: token 0 twice, token 1 once.
  // repetition 2, then frequency 0.5 per occurrence, then presence 0.25:
  //   0:  2 / 2 - 0.5*2 - 0.25 = -0.25
  //   1: -1 * 2 - 0.5*1 - 0.25 = -2.75
  //   2: 0.5 / 2               =  0.25
  //   3: untouched             =  3
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f};
  const std::vector<float> expected = {-0.25f, -2.75f, 0.25f, 3.0f};
  PenaltyState history;
  history.AddPromptTokens(std::vector<int32_t>{2, 2});
  history.AddOutputTokens({0, 1, 0});
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.logprobs = true;
  p.top_logprobs = 4;
  Sampler sampler(4);
  SampleRequest req = Request(logits, p);
  req.history = &history;
  auto r = sampler.Sample(req);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> ref = RefLogSoftmax(expected, 1.0);
  EXPECT_EQ(r->token_id, 3);
  ASSERT_EQ(r->top.size(), 4u);
  const int order[] = {3, 2, 0, 1};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r->top[i].token_id, order[i]);
    EXPECT_NEAR(r->top[i].logprob, ref[order[i]], 1e-6);
  }
  // A penalty big enough flips greedy's choice.
  history.AddOutputTokens({3, 3, 3, 3});
  p.frequency_penalty = 2.0f;
  EXPECT_EQ(sampler.Sample(req)->token_id, 2);
}

TEST(SamplerTest, LogitBiasIsAddedBeforePenaltiesAndTemperature) {
  // logits {2, -1, 0.5, 3}; bias {0: +1.5, 3: -100}; prompt {2}, output {0}:
  // bias first, then repetition 2, then presence 0.25, then temperature 0.5:
  //   0: (2 + 1.5) / 2 - 0.25 = 1.5    → 3
  //   1: -1                            → -2
  //   2: 0.5 / 2 = 0.25                → 0.5
  //   3: 3 - 100 = -97 (not in the history) → -194
  // (Penalties before the bias would give token 0 (2/2 - 0.25 + 1.5) = 2.25.)
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f};
  const std::vector<float> expected = {3.0f, -2.0f, 0.5f, -194.0f};
  PenaltyState history;
  history.AddPromptTokens(std::vector<int32_t>{2});
  history.AddOutputTokens({0});
  SamplingParams p;
  p.logit_bias = {{0, 1.5f}, {3, -100.0f}};
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.25f;
  p.temperature = 0.5f;
  p.seed = 11;
  p.logprobs = true;
  p.top_logprobs = 4;
  ASSERT_TRUE(p.Validate().ok());
  Sampler sampler(4);
  SampleRequest req = Request(logits, p);
  req.history = &history;
  auto r = sampler.Sample(req);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> ref = RefLogSoftmax(expected, 1.0);
  ASSERT_EQ(r->top.size(), 4u);
  const int order[] = {0, 2, 1, 3};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r->top[i].token_id, order[i]);
    EXPECT_NEAR(r->top[i].logprob, ref[order[i]], 1e-5);
  }
  // Greedy: without the bias token 3 wins; with it token 0 does, and a bias on
  // a suppressed token does not bring it back.
  SamplingParams g;
  EXPECT_EQ(sampler.Sample(Request(logits, g))->token_id, 3);
  g.logit_bias = {{0, 1.5f}, {3, -100.0f}};
  EXPECT_EQ(sampler.Sample(Request(logits, g))->token_id, 0);
  g.logit_bias = {{1, 100.0f}};
  SampleRequest sup = Request(logits, g);
  const std::vector<int32_t> suppressed = {1};
  sup.suppressed_tokens = suppressed;
  EXPECT_EQ(sampler.Sample(sup)->token_id, 3);
  EXPECT_EQ(sampler.Sample(Request(logits, g))->token_id, 1);
}

TEST(ScoreTokenTest, MatchesFloat64ReferenceWithRankAndTies) {
  const std::vector<float> logits = RandomLogits(kK3Vocab, 3.0, 7);
  const std::vector<double> ref = RefLogSoftmax(logits, 1.0);
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[a] > logits[b]; });
  for (const int32_t token :
       {order[0], order[1], order[57], order.back(), int32_t{5}}) {
    auto r = ScoreToken(logits, token, 5);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->token_id, token);
    EXPECT_NEAR(r->logprob, ref[token], 1e-4);
    const int32_t rank = static_cast<int32_t>(
        std::find(order.begin(), order.end(), token) - order.begin() + 1);
    EXPECT_EQ(r->rank, rank) << token;
    ASSERT_EQ(r->top.size(), 5u);
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(r->top[k].token_id, order[k]);
      EXPECT_NEAR(r->top[k].logprob, ref[order[k]], 1e-4);
    }
  }
  // Ties: the lower id first, and a tied token's rank counts only those above.
  const std::vector<float> tied = {1.0f, 3.0f, 3.0f, -1.0f, 3.0f};
  auto t = ScoreToken(tied, 4, 3);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->rank, 1);
  ASSERT_EQ(t->top.size(), 3u);
  EXPECT_EQ(t->top[0].token_id, 1);
  EXPECT_EQ(t->top[1].token_id, 2);
  EXPECT_EQ(t->top[2].token_id, 4);
  EXPECT_EQ(ScoreToken(tied, 3, 0)->rank, 5);
  EXPECT_TRUE(ScoreToken(tied, 3, 0)->top.empty());
  // -inf tokens are no alternatives: fewer than top_n where fewer are finite.
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::vector<float> sparse = {ninf, 2.0f, ninf, 1.0f, ninf};
  auto sp = ScoreToken(sparse, 3, 4);
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_EQ(sp->rank, 2);
  ASSERT_EQ(sp->top.size(), 2u);
  EXPECT_EQ(sp->top[0].token_id, 1);
  EXPECT_EQ(sp->top[1].token_id, 3);
  // Errors, not garbage.
  EXPECT_THAT(ScoreToken(tied, 5, 0).status().message(), HasSubstr("outside"));
  EXPECT_THAT(ScoreToken(tied, 0, 21).status().message(), HasSubstr("top_n"));
  std::vector<float> bad = tied;
  bad[2] = std::nanf("");
  EXPECT_THAT(ScoreToken(bad, 0, 1).status().message(), HasSubstr("NaN"));
}

TEST(SamplerTest, LogprobsMatchFloat64ReferenceOnFullVocab) {
  const std::vector<float> logits = RandomLogits(kK3Vocab, 3.0, 1);
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = 5;
  p.logprobs = true;
  p.top_logprobs = 20;
  Sampler sampler(kK3Vocab);
  auto r = sampler.Sample(Request(logits, p));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> ref = RefLogSoftmax(logits, 0.7);
  EXPECT_NEAR(r->logprob, ref[r->token_id], 1e-4);
  std::vector<int> order(kK3Vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 20, order.end(),
                    [&](int a, int b) { return ref[a] > ref[b]; });
  ASSERT_EQ(r->top.size(), 20u);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(r->top[i].token_id, order[i]) << i;
    EXPECT_NEAR(r->top[i].logprob, ref[order[i]], 1e-4);
  }
}

TEST(SamplerTest, GreedyLogprobsAreAtTemperatureOne) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f};
  SamplingParams p;
  p.logprobs = true;
  Sampler sampler(3);
  auto r = sampler.Sample(Request(logits, p));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token_id, 2);
  EXPECT_NEAR(r->logprob, RefLogSoftmax(logits, 1.0)[2], 1e-6);
  EXPECT_TRUE(r->top.empty());
}

struct TruncCase {
  const char* name;
  int top_k;
  float top_p;
  float min_p;
  std::vector<double> want;
};

TEST(SamplerTest, TruncationMatchesHandComputedDistributions) {
  // p = [0.5, 0.25, 0.15, 0.1]
  const std::vector<float> logits = LogitsFromProbs({0.5, 0.25, 0.15, 0.1});
  const TruncCase cases[] = {
      {"none", 0, 1.0f, 0.0f, {0.5, 0.25, 0.15, 0.1}},
      {"top_k2", 2, 1.0f, 0.0f, {2 / 3.0, 1 / 3.0, 0, 0}},
      {"top_k_vocab", 4, 1.0f, 0.0f, {0.5, 0.25, 0.15, 0.1}},
      {"top_p0.7", 0, 0.7f, 0.0f, {2 / 3.0, 1 / 3.0, 0, 0}},
      {"top_p0.8", 0, 0.8f, 0.0f, {0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0}},
      {"top_p0.3", 0, 0.3f, 0.0f, {1, 0, 0, 0}},
      // top-p over the top-k-renormalised distribution: 0.5/0.9 = 0.556.
      {"k3_p0.7", 3, 0.7f, 0.0f, {2 / 3.0, 1 / 3.0, 0, 0}},
      // 0.52 separates the two: over the full distribution 0.5 < 0.52 would
      // keep two tokens; over top-3 0.556 >= 0.52 keeps one.
      {"k3_p0.52", 3, 0.52f, 0.0f, {1, 0, 0, 0}},
      {"k0_p0.52", 0, 0.52f, 0.0f, {2 / 3.0, 1 / 3.0, 0, 0}},
      {"k3_p0.56", 3, 0.56f, 0.0f, {2 / 3.0, 1 / 3.0, 0, 0}},
      // min-p: keep p >= min_p * 0.5.
      {"min_p0.35", 0, 1.0f, 0.35f, {2 / 3.0, 1 / 3.0, 0, 0}},
      {"min_p0.25", 0, 1.0f, 0.25f, {0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0}},
      {"min_p0.6", 0, 1.0f, 0.6f, {1, 0, 0, 0}},
      {"p0.8_min_p0.4", 0, 0.8f, 0.4f, {2 / 3.0, 1 / 3.0, 0, 0}},
  };
  Sampler sampler(4);
  for (const TruncCase& c : cases) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = 1;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    std::vector<float> probs;
    ASSERT_TRUE(sampler.Distribution(Request(logits, p), &probs).ok());
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(probs[i], c.want[i], 1e-6) << c.name << " token " << i;
    }
  }
}

TEST(SamplerTest, TruncationMatchesSortReferenceOnFullVocab) {
  struct Case {
    double scale;  // logit spread: small = nearly flat
    float t;
    int top_k;
    float top_p;
    float min_p;
  };
  const Case cases[] = {
      {3.0, 1.0f, 50, 1.0f, 0.0f},     {3.0, 0.8f, 0, 0.9f, 0.0f},
      {3.0, 1.0f, 0, 1.0f, 0.05f},     {3.0, 1.2f, 1000, 0.95f, 0.0f},
      {3.0, 1.0f, 40, 0.9f, 0.1f},     {0.3, 1.0f, 0, 0.5f, 0.0f},
      {0.3, 1.0f, 100000, 0.9f, 0.0f}, {0.3, 1.0f, 0, 1.0f, 0.5f},
      {0.3, 0.5f, 20, 0.99f, 0.9f},    {8.0, 1.0f, 0, 0.999f, 1e-9f},
      {1.0, 1.0f, 0, 1.0f, 1e-9f},     {1.0, 1.0f, 5000, 1.0f, 0.3f},
  };
  Sampler sampler(kK3Vocab);
  int seed = 100;
  for (const Case& c : cases) {
    const std::vector<float> logits = RandomLogits(kK3Vocab, c.scale, seed++);
    SamplingParams p;
    p.temperature = c.t;
    p.seed = 3;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    std::vector<float> probs;
    ASSERT_TRUE(sampler.Distribution(Request(logits, p), &probs).ok());
    const std::vector<double> ref =
        RefDistribution(logits, c.t, c.top_k, c.top_p, c.min_p);
    int64_t kept = 0, ref_kept = 0, mismatched = 0;
    double max_err = 0.0;
    for (int64_t i = 0; i < kK3Vocab; ++i) {
      kept += probs[i] > 0;
      ref_kept += ref[i] > 0;
      mismatched += (probs[i] > 0) != (ref[i] > 0);
      max_err = std::max(max_err, std::abs(probs[i] - ref[i]));
    }
    EXPECT_EQ(mismatched, 0) << "k=" << c.top_k << " p=" << c.top_p
                             << " min_p=" << c.min_p << " scale=" << c.scale;
    EXPECT_EQ(kept, ref_kept);
    EXPECT_LT(max_err, 1e-6);
    // The sampled token is always inside the kept set.
    for (int pos = 0; pos < 20; ++pos) {
      auto r = sampler.Sample(Request(logits, p, pos));
      ASSERT_TRUE(r.ok());
      EXPECT_GT(ref[r->token_id], 0.0);
    }
  }
}

TEST(SamplerTest, EmpiricalFrequenciesMatchTheDistribution) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -3.0f};
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 5;
  p.seed = 77;
  Sampler sampler(6);
  std::vector<float> probs;
  ASSERT_TRUE(sampler.Distribution(Request(logits, p), &probs).ok());
  EXPECT_EQ(probs[5], 0.0f);  // cut by top-k
  constexpr int kN = 60000;
  std::vector<int> counts(6, 0);
  for (int i = 0; i < kN; ++i)
    ++counts[sampler.Sample(Request(logits, p, i))->token_id];
  double chi2 = 0.0;
  for (int i = 0; i < 6; ++i) {
    if (probs[i] == 0.0f) {
      EXPECT_EQ(counts[i], 0);
      continue;
    }
    const double e = kN * probs[i];
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  // 4 degrees of freedom: P(chi2 > 23.5) ~ 1e-4.
  EXPECT_LT(chi2, 23.5);
}

TEST(SamplerTest, SameSeedAndPositionGiveTheSameTokenWhateverElseRuns) {
  const std::vector<float> a = RandomLogits(kK3Vocab, 2.0, 7);
  const std::vector<float> b = RandomLogits(kK3Vocab, 2.0, 8);
  SamplingParams pa;
  pa.temperature = 1.0f;
  pa.top_p = 0.95f;
  pa.seed = 1234;
  SamplingParams pb = pa;
  pb.seed = 99;
  pb.top_k = 7;
  // Alone, one sampler per "worker".
  std::vector<int32_t> alone;
  {
    Sampler s(kK3Vocab);
    for (int pos = 0; pos < 16; ++pos)
      alone.push_back(s.Sample(Request(a, pa, pos))->token_id);
  }
  // Interleaved with another request in a shared sampler ("batch"), in
  // reverse position order, starting at position 8 (a hand-off mid-stream).
  Sampler shared(kK3Vocab);
  for (int pos = 15; pos >= 8; --pos) {
    ASSERT_TRUE(shared.Sample(Request(b, pb, pos)).ok());
    EXPECT_EQ(shared.Sample(Request(a, pa, pos))->token_id, alone[pos]) << pos;
  }
  // Not constant: a different seed changes the sequence.
  std::vector<int32_t> other;
  SamplingParams pc = pa;
  pc.seed = 1235;
  for (int pos = 0; pos < 16; ++pos)
    other.push_back(shared.Sample(Request(a, pc, pos))->token_id);
  EXPECT_NE(other, alone);
}

TEST(SamplerTest, ConsecutivePositionsAreIndependent) {
  // Uniform over 2 tokens: pairs (token at i, token at i + 1) are uniform.
  const std::vector<float> logits = {0.0f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 2024;
  Sampler sampler(2);
  constexpr int kN = 40000;
  int pairs[2][2] = {};
  int prev = sampler.Sample(Request(logits, p, 0))->token_id;
  for (int i = 1; i <= kN; ++i) {
    const int t = sampler.Sample(Request(logits, p, i))->token_id;
    ++pairs[prev][t];
    prev = t;
  }
  double chi2 = 0.0;
  for (auto& row : pairs) {
    for (int c : row) chi2 += (c - kN / 4.0) * (c - kN / 4.0) / (kN / 4.0);
  }
  EXPECT_LT(chi2, 21.1);  // 3 dof, P ~ 1e-4
}

TEST(SamplerTest, SuppressedTokensAreNeverChosen) {
  const std::vector<float> logits = {5.0f, 4.9f, 0.0f};
  SamplingParams greedy;
  Sampler sampler(3);
  const std::vector<int32_t> banned = {0};
  SampleRequest r = Request(logits, greedy);
  r.suppressed_tokens = banned;
  EXPECT_EQ(sampler.Sample(r)->token_id, 1);
  SamplingParams p;
  p.temperature = 2.0f;
  p.seed = 8;
  r.params = &p;
  for (int i = 0; i < 500; ++i) {
    r.position = i;
    EXPECT_NE(sampler.Sample(r)->token_id, 0);
  }
}

TEST(SamplerTest, BadInputsGiveErrors) {
  Sampler sampler(3);
  SamplingParams p;
  p.temperature = 1.0f;
  const std::vector<float> ok = {0.0f, 1.0f, 2.0f};
  EXPECT_THAT(sampler.Sample(Request(ok, p)).status().message(),
              HasSubstr("needs a seed"));
  p.seed = 1;
  const std::vector<float> short_row = {0.0f, 1.0f};
  EXPECT_THAT(sampler.Sample(Request(short_row, p)).status().message(),
              HasSubstr("logits row has 2 entries, vocabulary has 3"));
  const std::vector<float> nan_row = {0.0f, NAN, 2.0f};
  EXPECT_THAT(sampler.Sample(Request(nan_row, p)).status().message(), HasSubstr("NaN"));
  const std::vector<float> masked = {kNegInf, kNegInf, kNegInf};
  EXPECT_THAT(sampler.Sample(Request(masked, p)).status().message(),
              HasSubstr("all logits -inf"));
  SamplingParams greedy;
  EXPECT_THAT(sampler.Sample(Request(masked, greedy)).status().message(),
              HasSubstr("all logits -inf"));
  EXPECT_THAT(sampler.Sample(Request(nan_row, greedy)).status().message(),
              HasSubstr("NaN"));
}

TEST(SamplerTest, TopKLargerThanFiniteTokensNeverPicksMaskedOnes) {
  std::vector<float> logits(50, kNegInf);
  logits[10] = 1.0f;
  logits[20] = 0.5f;
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 30;
  p.seed = 4;
  Sampler sampler(50);
  std::vector<float> probs;
  ASSERT_TRUE(sampler.Distribution(Request(logits, p), &probs).ok());
  EXPECT_NEAR(probs[10] + probs[20], 1.0, 1e-6);
  for (int pos = 0; pos < 200; ++pos) {
    const int32_t t = sampler.Sample(Request(logits, p, pos))->token_id;
    EXPECT_TRUE(t == 10 || t == 20) << t;
  }
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

std::vector<uint32_t> MaskOf(int64_t vocab, const std::vector<int32_t>& allowed) {
  std::vector<uint32_t> mask((vocab + 31) / 32, 0u);
  for (int32_t id : allowed) mask[id >> 5] |= 1u << (id & 31);
  return mask;
}

TEST(SamplerMaskTest, GreedyTakesTheBestAllowedToken) {
  const int64_t V = 1000;
  std::vector<float> logits = RandomLogits(V, 3.0, 7);
  const std::vector<int32_t> allowed = {3, 97, 512, 999};
  const std::vector<uint32_t> mask = MaskOf(V, allowed);
  int32_t best = allowed[0];
  for (int32_t id : allowed) {
    if (logits[id] > logits[best]) best = id;
  }
  Sampler s(V);
  SamplingParams p;
  SampleRequest r;
  r.logits = logits;
  r.params = &p;
  r.allowed_bitmask = mask;
  absl::StatusOr<SampleResult> got = s.Sample(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->token_id, best);
}

TEST(SamplerMaskTest, DistributionIsTheRenormalisedAllowedSet) {
  const int64_t V = 4096;
  std::vector<float> logits = RandomLogits(V, 2.0, 11);
  std::vector<int32_t> allowed;
  for (int32_t i = 5; i < V; i += 37) allowed.push_back(i);
  const std::vector<uint32_t> mask = MaskOf(V, allowed);
  // The reference: the allowed logits alone, at temperature 0.7, top_p 0.9.
  std::vector<float> sub;
  for (int32_t id : allowed) sub.push_back(logits[id]);
  const std::vector<double> ref = RefDistribution(sub, 0.7, 0, 0.9, 0.0);
  Sampler s(V);
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.seed = 1;
  SampleRequest r;
  r.logits = logits;
  r.params = &p;
  r.allowed_bitmask = mask;
  std::vector<float> probs;
  ASSERT_TRUE(s.Distribution(r, &probs).ok());
  double outside = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (((mask[i >> 5] >> (i & 31)) & 1u) == 0) outside += probs[i];
  }
  EXPECT_EQ(outside, 0.0);
  for (size_t k = 0; k < allowed.size(); ++k) {
    EXPECT_NEAR(probs[allowed[k]], ref[k], 1e-5) << allowed[k];
  }
  // Seeded draws land in the allowed set.
  for (int pos = 0; pos < 200; ++pos) {
    r.position = pos;
    absl::StatusOr<SampleResult> got = s.Sample(r);
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE((mask[got->token_id >> 5] >> (got->token_id & 31)) & 1u);
  }
}

TEST(SamplerMaskTest, PenaltiesApplyAfterTheMask) {
  const int64_t V = 64;
  std::vector<float> logits(V, 0.0f);
  logits[10] = 5.0f;  // allowed, penalised below token 20
  logits[20] = 4.0f;  // allowed
  logits[30] = 9.0f;  // best, masked out
  const std::vector<uint32_t> mask = MaskOf(V, {10, 20});
  PenaltyState h;
  h.AddOutputToken(10);
  SamplingParams p;
  p.presence_penalty = 2.0f;
  Sampler s(V);
  SampleRequest r;
  r.logits = logits;
  r.params = &p;
  r.history = &h;
  r.allowed_bitmask = mask;
  absl::StatusOr<SampleResult> got = s.Sample(r);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->token_id, 20);
}

TEST(SamplerMaskTest, NoAllowedTokenIsAnErrorNotAChoice) {
  const int64_t V = 128;
  std::vector<float> logits(V, 1.0f);
  Sampler s(V);
  SamplingParams greedy;
  SamplingParams random;
  random.temperature = 1.0f;
  random.seed = 3;
  const std::vector<uint32_t> empty = MaskOf(V, {});
  const std::vector<uint32_t> only_suppressed = MaskOf(V, {7});
  const std::vector<int32_t> suppressed = {7};
  for (const SamplingParams* p : {&greedy, &random}) {
    SampleRequest r;
    r.logits = logits;
    r.params = p;
    r.allowed_bitmask = empty;
    EXPECT_EQ(s.Sample(r).status().code(), absl::StatusCode::kFailedPrecondition);
    r.allowed_bitmask = only_suppressed;
    r.suppressed_tokens = suppressed;
    EXPECT_EQ(s.Sample(r).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  SampleRequest short_mask;
  short_mask.logits = logits;
  short_mask.params = &greedy;
  const std::vector<uint32_t> three(3, ~0u);
  short_mask.allowed_bitmask = three;
  EXPECT_EQ(s.Sample(short_mask).status().code(), absl::StatusCode::kInvalidArgument);
}

// The mask is applied before the NaN / +inf check: a bad logit in a disallowed
// position is never read (whole 32-token words and the last partial word, V
// not a multiple of 32). Greedy ties, -0.0 equal to +0.0 included, go to the
// lowest allowed id, as in the scalar argmax.
TEST(SamplerMaskTest, BadLogitsOutsideTheMaskAreIgnoredAndTiesTakeTheLowestId) {
  const int64_t V = 70;  // two whole words and a 6-token tail
  std::vector<float> logits(V, -1.0f);
  for (int32_t i : {0, 5, 31, 33, 40, 63, 64, 69}) {
    logits[i] = (i % 2 == 0) ? NAN : std::numeric_limits<float>::infinity();
  }
  logits[12] = -0.0f;  // allowed: ties with 50 and 66, first
  logits[50] = 0.0f;
  logits[66] = 0.0f;
  const std::vector<uint32_t> mask = MaskOf(V, {3, 12, 50, 66, 67});
  Sampler s(V);
  SamplingParams greedy;
  SamplingParams random;
  random.temperature = 1.0f;
  random.seed = 5;
  for (const SamplingParams* p : {&greedy, &random}) {
    SampleRequest r;
    r.logits = logits;
    r.params = p;
    r.allowed_bitmask = mask;
    absl::StatusOr<SampleResult> got = s.Sample(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE((mask[got->token_id >> 5] >> (got->token_id & 31)) & 1u);
    if (p == &greedy) EXPECT_EQ(got->token_id, 12);
  }
  // The same bad logit inside the mask is an error, in a whole word and in
  // the tail.
  for (int32_t bad : {5, 64, 69}) {
    const std::vector<uint32_t> with_bad = MaskOf(V, {3, 12, bad});
    for (const SamplingParams* p : {&greedy, &random}) {
      SampleRequest r;
      r.logits = logits;
      r.params = p;
      r.allowed_bitmask = with_bad;
      EXPECT_EQ(s.Sample(r).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    }
  }
}

}  // namespace
}  // namespace tandem::engine
