#include "engine/sampling/penalty_state.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

TEST(PenaltyStateTest, CountsOutputAndDeduplicatesPrompt) {
  PenaltyState s;
  s.AddPromptTokens(std::vector<int32_t>{4, 4, 9});
  s.AddOutputTokens({1, 1, 4});
  EXPECT_EQ(s.prompt_tokens().size(), 2u);
  EXPECT_TRUE(s.prompt_tokens().contains(9));
  EXPECT_EQ(s.output_counts().at(1), 2);
  EXPECT_EQ(s.output_counts().at(4), 1);
  EXPECT_EQ(s.num_output_tokens(), 3);
  // Speculative rollback forgets one occurrence at a time.
  s.RemoveOutputToken(1);
  EXPECT_EQ(s.output_counts().at(1), 1);
  s.RemoveOutputToken(4);
  EXPECT_FALSE(s.output_counts().contains(4));
  s.RemoveOutputToken(77);  // never generated: no change
  EXPECT_EQ(s.num_output_tokens(), 1);
}

}  // namespace
}  // namespace tandem::engine
