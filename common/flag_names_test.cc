#include "common/flag_names.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, max_tokens, 1, "test flag");
ABSL_FLAG(std::string, prompt, "", "test flag");
ABSL_FLAG(bool, ignore_eos, false, "test flag");
ABSL_FLAG(bool, json, false, "test flag");

namespace tandem {
namespace {

struct Case {
  std::string name;
  std::vector<std::string> in, want;
};

class FlagNamesTest : public ::testing::TestWithParam<Case> {};

TEST_P(FlagNamesTest, Normalises) {
  std::vector<std::string> args = {"prog"};
  args.insert(args.end(), GetParam().in.begin(), GetParam().in.end());
  std::vector<std::string> want = {"prog"};
  want.insert(want.end(), GetParam().want.begin(), GetParam().want.end());
  EXPECT_EQ(NormalizeFlagNames(args), want);
}

INSTANTIATE_TEST_SUITE_P(
    Table, FlagNamesTest,
    ::testing::Values(
        Case{"separate_value", {"--max-tokens", "8"}, {"--max_tokens", "8"}},
        Case{"joined_value", {"--max-tokens=8"}, {"--max_tokens=8"}},
        Case{"single_dash", {"-max-tokens=8"}, {"-max_tokens=8"}},
        Case{"underscores_kept",
             {"--max_tokens=8", "--json"},
             {"--max_tokens=8", "--json"}},
        Case{"value_with_hyphens_kept",
             {"--prompt=a-b", "--prompt", "--max-tokens", "--max-tokens", "2"},
             {"--prompt=a-b", "--prompt", "--max-tokens", "--max_tokens", "2"}},
        Case{"bool_takes_no_value",
             {"--ignore-eos", "--max-tokens=3"},
             {"--ignore_eos", "--max_tokens=3"}},
        Case{"bool_with_value", {"--ignore-eos=false"}, {"--ignore_eos=false"}},
        Case{"negated_bool",
             {"--no-ignore-eos", "--noignore_eos", "--no_json"},
             {"--noignore_eos", "--noignore_eos", "--nojson"}},
        Case{"unknown_left_for_absl",
             {"--max-token=3", "--no-prompt"},
             {"--max-token=3", "--no-prompt"}},
        Case{"positional_and_terminator",
             {"file-name", "--", "--max-tokens"},
             {"file-name", "--", "--max-tokens"}},
        Case{"lone_dashes", {"-", "--=x"}, {"-", "--=x"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(FlagNamesInPlaceTest, RewritesArgvStrings) {
  char a0[] = "prog", a1[] = "--max-tokens=8", a2[] = "--no-ignore-eos", a3[] = "x-y";
  char* argv[] = {a0, a1, a2, a3};
  NormalizeFlagNames(4, argv);
  EXPECT_STREQ(argv[1], "--max_tokens=8");
  EXPECT_STREQ(argv[2], "--noignore_eos");
  EXPECT_STREQ(argv[3], "x-y");
}

}  // namespace
}  // namespace tandem
