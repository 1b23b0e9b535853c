#include "metrics/buckets.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(BucketsTest, Validate) {
  EXPECT_TRUE(ValidateBuckets({1}).ok());
  EXPECT_TRUE(ValidateBuckets({-5, 0, 0.5, 1e9}).ok());
  EXPECT_FALSE(ValidateBuckets({}).ok());
  EXPECT_FALSE(ValidateBuckets({1, 1}).ok());
  EXPECT_FALSE(ValidateBuckets({2, 1}).ok());
  EXPECT_FALSE(ValidateBuckets({1, kInf}).ok());
  EXPECT_FALSE(ValidateBuckets({-kInf, 1}).ok());
  EXPECT_FALSE(ValidateBuckets({1, std::nan(""), 3}).ok());
}

TEST(BucketsTest, Exponential) {
  auto b = ExponentialBuckets(0.001, 2, 5);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<double>{0.001, 0.002, 0.004, 0.008, 0.016}));
  auto one = ExponentialBuckets(3, 10, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, (std::vector<double>{3}));

  EXPECT_FALSE(ExponentialBuckets(0, 2, 5).ok());
  EXPECT_FALSE(ExponentialBuckets(-1, 2, 5).ok());
  EXPECT_FALSE(ExponentialBuckets(1, 1, 5).ok());
  EXPECT_FALSE(ExponentialBuckets(1, 0.5, 5).ok());
  EXPECT_FALSE(ExponentialBuckets(1, 2, 0).ok());
  EXPECT_FALSE(ExponentialBuckets(1, kInf, 2).ok());
  EXPECT_FALSE(ExponentialBuckets(1e300, 1e10, 3).ok());  // overflows to +Inf
}

TEST(BucketsTest, Linear) {
  auto b = LinearBuckets(-1, 0.5, 5);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<double>{-1, -0.5, 0, 0.5, 1}));
  // Bound i is start + i*width, not an accumulated sum: 0.1*3 is the double
  // nearest 0.3 computed as 3*0.1.
  auto tenths = LinearBuckets(0, 0.1, 4);
  ASSERT_TRUE(tenths.ok());
  EXPECT_EQ((*tenths)[3], 3 * 0.1);

  EXPECT_FALSE(LinearBuckets(0, 0, 3).ok());
  EXPECT_FALSE(LinearBuckets(0, -1, 3).ok());
  EXPECT_FALSE(LinearBuckets(0, 1, 0).ok());
  EXPECT_FALSE(LinearBuckets(kInf, 1, 2).ok());
  EXPECT_FALSE(LinearBuckets(1e20, 1, 3).ok());  // width too small to move the bound
}

}  // namespace
}  // namespace tandem::metrics
