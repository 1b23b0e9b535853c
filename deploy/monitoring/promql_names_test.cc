#include "deploy/monitoring/promql_names.h"

#include "gtest/gtest.h"

namespace tandem::monitoring {
namespace {

std::vector<SeriesRef> Refs(const std::string& expr) {
  auto r = SeriesRefs(expr);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<SeriesRef>{};
}

TEST(SeriesRefsTest, HistogramQuantileOverRate) {
  EXPECT_EQ(Refs("histogram_quantile(0.99, sum by (le, component) "
                 "(rate(tandem_x_seconds_bucket{outcome=\"ok\"}[5m])))"),
            (std::vector<SeriesRef>{{"tandem_x_seconds_bucket", "rate", {"outcome"}}}));
}

TEST(SeriesRefsTest, BinaryOperationsAndGroupingModifiers) {
  EXPECT_EQ(
      Refs("sum without (state) (a_total{state=~\"u.*\", b!=\"x\"}) / ignoring(state) "
           "group_left(le) (b) > on (component) max by (component) "
           "(label_replace(c, \"component\", \"$1\", \"role\", \"(.*)\")) and bool d"),
      (std::vector<SeriesRef>{{"a_total", "sum", {"b", "state"}},
                              {"b", "", {}},
                              {"c", "label_replace", {}},
                              {"d", "", {}}}));
}

TEST(SeriesRefsTest, AggregationWithTrailingByAndPlainParentheses) {
  EXPECT_EQ(Refs("sum((rate(x_total[1m]) + y)) by (instance)"),
            (std::vector<SeriesRef>{{"x_total", "rate", {}}, {"y", "sum", {}}}));
}

TEST(SeriesRefsTest, RecordingRuleNamesNumbersDurationsAndGrafanaVariables) {
  EXPECT_EQ(Refs("component:tandem_x:p99_5m > 2.5e-3 * 1e+2 offset 5m or "
                 "rate(z_total[$__rate_interval]) > Inf # comment tandem_not_read\n"
                 "  + max_over_time(g[10m:1m])"),
            (std::vector<SeriesRef>{{"component:tandem_x:p99_5m", "", {}},
                                    {"z_total", "rate", {}},
                                    {"g", "max_over_time", {}}}));
}

TEST(SeriesRefsTest, KeywordsAreCaseInsensitiveAndStringsAreSkipped) {
  EXPECT_EQ(Refs("SUM BY (le) (a{l='it\\'s \"q\"', m=`raw\\`}) UNLESS b"),
            (std::vector<SeriesRef>{{"a", "sum", {"l", "m"}}, {"b", "", {}}}));
}

TEST(SeriesRefsTest, Errors) {
  EXPECT_FALSE(SeriesRefs("rate(x[5m]").ok());
  EXPECT_FALSE(SeriesRefs("rate(x[5m]))").ok());
  EXPECT_FALSE(SeriesRefs("x{a=\"1\"").ok());
  EXPECT_FALSE(SeriesRefs("x{a=1}").ok());
  EXPECT_FALSE(SeriesRefs("{__name__=\"x\"}").ok());
  EXPECT_FALSE(SeriesRefs("x[5m").ok());
  EXPECT_FALSE(SeriesRefs("x{a=\"1}").ok());
}

}  // namespace
}  // namespace tandem::monitoring
