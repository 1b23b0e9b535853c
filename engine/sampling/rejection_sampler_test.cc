#include "engine/sampling/rejection_sampler.h"

#include <cmath>
#include <random>
#include <vector>

#include "engine/sampling/counter_rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

std::vector<float> RandomDistribution(int n, std::mt19937& rng, int zeros) {
  std::gamma_distribution<double> g(0.7, 1.0);
  std::vector<double> w(n);
  double s = 0.0;
  for (int i = 0; i < n; ++i) {
    w[i] = i < zeros ? 0.0 : g(rng);
    s += w[i];
  }
  std::vector<float> out;
  for (double v : w) out.push_back(static_cast<float>(v / s));
  return out;
}

double ChiSquare(const std::vector<int>& counts, const std::vector<float>& p, int n,
                 int* dof) {
  double chi2 = 0.0;
  *dof = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0.0f) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has zero target mass";
      continue;
    }
    ++*dof;
    const double e = n * static_cast<double>(p[i]);
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi2;
}

// Emitted tokens must follow the target distributions exactly, whatever the
// draft distribution: position 0 always, position 1 whenever it is emitted.
TEST(RejectionSamplerTest, OutputDistributionMatchesTarget) {
  constexpr int kVocab = 8;
  constexpr int kDrafts = 3;
  constexpr int kTrials = 100000;
  std::mt19937 rng(11);
  std::vector<std::vector<float>> p_rows, q_rows;
  // The target gives token 0 no mass at position 0; the draft may propose it.
  for (int j = 0; j <= kDrafts; ++j)
    p_rows.push_back(RandomDistribution(kVocab, rng, j == 0 ? 1 : 0));
  for (int j = 0; j < kDrafts; ++j)
    q_rows.push_back(RandomDistribution(kVocab, rng, 0));
  std::vector<float> target, draft;
  for (auto& r : p_rows) target.insert(target.end(), r.begin(), r.end());
  for (auto& r : q_rows) draft.insert(draft.end(), r.begin(), r.end());

  std::vector<int> first(kVocab, 0), second(kVocab, 0);
  int n_second = 0;
  double accepted_total = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const uint64_t seed = 1000 + trial;
    std::vector<int32_t> drafts;
    for (int j = 0; j < kDrafts; ++j) {
      drafts.push_back(DrawFromWeights(
          q_rows[j], CounterUniform(seed ^ 0xD1AF7, j, RngStream::kSample)));
    }
    auto r = RejectionSample(target, draft, drafts, kVocab, seed, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_GE(r->num_accepted, 0);
    ASSERT_LE(r->num_accepted, kDrafts);
    accepted_total += r->num_accepted;
    std::vector<int32_t> emitted(drafts.begin(), drafts.begin() + r->num_accepted);
    emitted.push_back(r->next_token);
    ++first[emitted[0]];
    if (emitted.size() > 1) {
      ++second[emitted[1]];
      ++n_second;
    }
  }
  int dof = 0;
  const double chi_first = ChiSquare(first, p_rows[0], kTrials, &dof);
  EXPECT_EQ(dof, 6);
  EXPECT_LT(chi_first, 27.9);  // 6 dof, P ~ 1e-4
  const double chi_second = ChiSquare(second, p_rows[1], n_second, &dof);
  EXPECT_EQ(dof, 7);
  EXPECT_LT(chi_second, 29.9);  // 7 dof
  EXPECT_GT(n_second, kTrials / 10);
  // Total variation as a second, scale-free check.
  double tv = 0.0;
  for (int i = 0; i < kVocab; ++i)
    tv += std::abs(first[i] / double(kTrials) - p_rows[0][i]);
  EXPECT_LT(tv / 2, 0.01);
  // Expected acceptance at position 0 is sum_x min(p, q) (> 0 here).
  EXPECT_GT(accepted_total, 0);
}

TEST(RejectionSamplerTest, IdenticalDistributionsAcceptEverything) {
  std::mt19937 rng(3);
  const std::vector<float> row = RandomDistribution(5, rng, 0);
  std::vector<float> target, draft;
  for (int j = 0; j < 3; ++j) target.insert(target.end(), row.begin(), row.end());
  for (int j = 0; j < 2; ++j) draft.insert(draft.end(), row.begin(), row.end());
  for (uint64_t seed = 0; seed < 200; ++seed) {
    auto r = RejectionSample(target, draft, {1, 4}, 5, seed, 10);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->num_accepted, 2);
    // The bonus token is plain sampling's draw at its position.
    EXPECT_EQ(r->next_token,
              DrawFromWeights(row, CounterUniform(seed, 12, RngStream::kSample)));
  }
}

TEST(RejectionSamplerTest, OneHotRowsBehaveLikeGreedy) {
  // Target argmax 2 then 0; draft proposes 2 then 1: accept one, correct to 0.
  const std::vector<float> target = {0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1};
  const std::vector<float> draft = {0, 0, 1, 0, 0, 1, 0, 0};
  auto r = RejectionSample(target, draft, {2, 1}, 4, 5, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->num_accepted, 1);
  EXPECT_EQ(r->next_token, 0);
}

TEST(RejectionSamplerTest, GreedyVerifyTable) {
  struct Case {
    std::vector<int32_t> argmax, drafts;
    int accepted;
    int32_t next;
  } cases[] = {
      {{5, 6, 7, 8}, {5, 6, 7}, 3, 8},
      {{5, 6, 7, 8}, {5, 9, 7}, 1, 6},
      {{5, 6, 7, 8}, {1, 6, 7}, 0, 5},
      {{4}, {}, 0, 4},
  };
  for (const Case& c : cases) {
    auto r = GreedyVerify(c.argmax, c.drafts);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->num_accepted, c.accepted);
    EXPECT_EQ(r->next_token, c.next);
  }
  EXPECT_THAT(GreedyVerify({1, 2}, {1, 2}).status().message(), HasSubstr("k + 1 = 3"));
}

TEST(RejectionSamplerTest, ShapeErrors) {
  const std::vector<float> row = {0.5f, 0.5f};
  EXPECT_THAT(RejectionSample(row, row, {0}, 2, 1, 0).status().message(),
              HasSubstr("target_probs must hold 2 rows of 2"));
  const std::vector<float> two = {0.5f, 0.5f, 0.5f, 0.5f};
  EXPECT_THAT(RejectionSample(two, row, {7}, 2, 1, 0).status().message(),
              HasSubstr("draft token 7 outside"));
}

}  // namespace
}  // namespace tandem::engine
