#include "engine/grammar/automaton.h"

#include "engine/grammar/ebnf_parser.h"
#include "engine/grammar/expr.h"
#include "gtest/gtest.h"

namespace tandem::grammar {
namespace {

absl::StatusOr<Automaton> Build(absl::string_view ebnf, CompileLimits limits = {}) {
  auto g = ParseEbnf(ebnf);
  if (!g.ok()) return g.status();
  CompileBudget budget(limits);
  return BuildAutomaton(*g, &budget);
}

TEST(AutomatonTest, UnicodeClassesEncodeAsUtf8) {
  CompileLimits limits;
  CompileBudget budget(limits);
  auto dfa = BuildDfa(
      *Codepoints({{0x41, 0x41}, {0xE9, 0xE9}, {0x4E2D, 0x4E2D}, {0x1F600, 0x1F600}}),
      &budget);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(dfa->Matches("A"));
  EXPECT_TRUE(dfa->Matches("\xC3\xA9"));          // é
  EXPECT_TRUE(dfa->Matches("\xE4\xB8\xAD"));      // 中
  EXPECT_TRUE(dfa->Matches("\xF0\x9F\x98\x80"));  // 😀
  EXPECT_FALSE(dfa->Matches("B"));
  EXPECT_FALSE(dfa->Matches("\xC3\xA8"));
  EXPECT_FALSE(dfa->Matches("\xC3"));
}

TEST(AutomatonTest, AnyCodepointRejectsInvalidUtf8) {
  CompileLimits limits;
  CompileBudget budget(limits);
  auto dfa = BuildDfa(*Star(Codepoints(AnyCodepoint())), &budget);
  ASSERT_TRUE(dfa.ok());
  EXPECT_TRUE(dfa->Matches("abc\xE2\x82\xAC"));
  EXPECT_FALSE(dfa->Matches("\xED\xA0\x80"));  // a surrogate
  EXPECT_FALSE(dfa->Matches("\xC0\x80"));      // overlong
  EXPECT_FALSE(dfa->Matches("\xFF"));
}

TEST(AutomatonTest, NonRecursiveRulesBecomeOneDfa) {
  auto a = Build(R"g(root ::= "a" b "c"
b ::= [0-9]+ | "x")g");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->rules[a->root].size(), 1u);
  ASSERT_EQ(a->rules[a->root][0].size(), 1u);
  EXPECT_EQ(a->rules[a->root][0][0].kind, Element::Kind::kDfa);
  const Dfa& d = a->dfas[a->rules[a->root][0][0].id];
  EXPECT_TRUE(d.Matches("a123c"));
  EXPECT_TRUE(d.Matches("axc"));
  EXPECT_FALSE(d.Matches("ac"));
}

TEST(AutomatonTest, RecursionUsesRuleCalls) {
  auto a = Build(R"g(root ::= "(" root ")" | "x")g");
  ASSERT_TRUE(a.ok()) << a.status();
  bool has_call = false;
  for (const auto& alt : a->rules[a->root]) {
    for (const Element& e : alt) has_call = has_call || e.kind == Element::Kind::kRule;
  }
  EXPECT_TRUE(has_call);
}

TEST(AutomatonTest, LeftRecursionIsRejectedByName) {
  auto a = Build(R"g(root ::= expr
expr ::= expr "+" term | term
term ::= [0-9])g");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("left recursion"), std::string::npos);
  EXPECT_NE(a.status().message().find("expr"), std::string::npos);
}

TEST(AutomatonTest, EmptyLanguageIsAnError) {
  auto a = Build(R"g(root ::= "a" root)g");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("no output"), std::string::npos);
}

TEST(AutomatonTest, StateBudgetIsResourceExhausted) {
  CompileLimits limits;
  limits.max_automaton_states = 2000;
  auto a = Build(R"g(root ::= ([a-z] [0-9]){0,999} "!")g", limits);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace tandem::grammar
