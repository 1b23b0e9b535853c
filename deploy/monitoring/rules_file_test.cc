#include "deploy/monitoring/rules_file.h"

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

#include "gtest/gtest.h"

namespace tandem::monitoring {
namespace {

TEST(ParseRulesTest, RecordAndAlertWithEveryExprForm) {
  const std::string yaml = R"(groups:
  # a comment
  - name: g1
    interval: 30s
    rules:
      - record: a:b:rate5m
        expr: sum(rate(x_total[5m]))
        labels:
          team: t
      - alert: Fires
        expr: |
          a:b:rate5m
            > 1
        for: 5m
        annotations:
          summary: 'it''s high'
  - name: g2
    rules:
      - alert: 'Quoted'
        expr: 'y{a=''1''} > 0'
      - record: folded
        expr: >-
          z
)";
  auto rules = ParseRules(yaml);
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 4u);
  EXPECT_EQ((*rules)[0].kind, "record");
  EXPECT_EQ((*rules)[0].name, "a:b:rate5m");
  EXPECT_EQ((*rules)[0].expr, "sum(rate(x_total[5m]))");
  EXPECT_EQ((*rules)[0].line, 6);
  EXPECT_EQ((*rules)[1].kind, "alert");
  EXPECT_EQ((*rules)[1].name, "Fires");
  EXPECT_EQ((*rules)[1].expr, "a:b:rate5m\n> 1\n");
  EXPECT_EQ((*rules)[2].name, "Quoted");
  EXPECT_EQ((*rules)[2].expr, "y{a='1'} > 0");
  EXPECT_EQ((*rules)[3].name, "folded");
  EXPECT_EQ((*rules)[3].expr, "z\n");
}

TEST(ParseRulesTest, Errors) {
  EXPECT_FALSE(
      ParseRules("groups:\n  - name: g\n    expr: x\n").ok());  // outside a rule
  EXPECT_FALSE(ParseRules("    rules:\n      - record: r\n        labels: {}\n").ok());
  EXPECT_FALSE(
      ParseRules("rules:\n  - record: r\n    expr: x\n    expr: y\n").ok());  // two
  EXPECT_FALSE(ParseRules("rules:\n  - record: r\n    expr: \"x\"\n").ok());
  EXPECT_FALSE(
      ParseRules("rules:\n  - record: r\n    expr: |\n  - record: s\n    expr: y\n")
          .ok());  // empty block
  EXPECT_FALSE(ParseRules("rules:\n  - record: r\n    labels:\n      expr: x\n")
                   .ok());  // nested
  EXPECT_FALSE(ParseRules("rules:\n  - record: r\n  - record: s\n    expr: x\n")
                   .ok());  // r has none
}

// The real rules file: as many rules as promtool counts, each with an expr.
TEST(ParseRulesTest, ReadsEveryRuleOfTheRealFileAsPromtoolDoes) {
  const std::string path = "deploy/monitoring/rules.yml";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  auto rules = ParseRules(text.str());
  ASSERT_TRUE(rules.ok()) << rules.status();

  FILE* p = popen(("promtool check rules " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0)
      << "promtool check rules failed (./tandem setup installs it):\n"
      << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("SUCCESS: ([0-9]+) rules found")))
      << out;
  EXPECT_EQ(rules->size(), std::stoul(m[1])) << out;
  int alerts = 0;
  for (const Rule& r : *rules) alerts += r.kind == "alert";
  EXPECT_GE(alerts, 5);
}

}  // namespace
}  // namespace tandem::monitoring
