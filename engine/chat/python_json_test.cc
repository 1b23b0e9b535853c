#include "engine/chat/python_json.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {
namespace {

// Expected values are what CPython 3 prints for repr(x).
TEST(PythonJsonTest, FloatReprMatchesPython) {
  struct Case {
    double value;
    const char* repr;
  } cases[] = {
      {1.5, "1.5"},
      {1.0, "1.0"},
      {100.0, "100.0"},
      {0.1, "0.1"},
      {1.0 / 3.0, "0.3333333333333333"},
      {1e-05, "1e-05"},
      {0.0001, "0.0001"},
      {0.00012345, "0.00012345"},
      {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},
      {1.5e16, "1.5e+16"},
      {123456789012345678.0, "1.2345678901234568e+17"},
      {1e100, "1e+100"},
      {2.5e-10, "2.5e-10"},
      {-0.0, "-0.0"},
      {-3.25, "-3.25"},
      {5e-324, "5e-324"},
      {std::numeric_limits<double>::infinity(), "Infinity"},
      {std::nan(""), "NaN"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(PythonFloatRepr(c.value), c.repr) << c.repr;
  }
}

TEST(PythonJsonTest, SeparatorsOrderAndEscapes) {
  const auto ordered = nlohmann::ordered_json::parse(
      R"({"b": 1, "a": [1, "x", null, true, 2.0], "c": {"d": "é\n\u0001\"\\/\t"}})");
  EXPECT_EQ(
      PythonJsonDumps(ordered, JsonSeparators::kPython),
      R"({"b": 1, "a": [1, "x", null, true, 2.0], "c": {"d": "é\n\u0001\"\\/\t"}})");
  EXPECT_EQ(PythonJsonDumps(ordered, JsonSeparators::kCompact),
            R"({"b":1,"a":[1,"x",null,true,2.0],"c":{"d":"é\n\u0001\"\\/\t"}})");
  // nlohmann::json keeps keys sorted: deep_sort_dict for free.
  const auto sorted =
      nlohmann::json::parse(R"({"z": {"y": 1, "x": 2}, "a": [{"q": 1, "p": 2}]})");
  EXPECT_EQ(PythonJsonDumps(sorted, JsonSeparators::kCompact),
            R"({"a":[{"p":2,"q":1}],"z":{"x":2,"y":1}})");
  EXPECT_EQ(PythonJsonDumps(nlohmann::json::array(), JsonSeparators::kPython), "[]");
  EXPECT_EQ(PythonJsonDumps(nlohmann::json::object(), JsonSeparators::kPython), "{}");
  EXPECT_EQ(PythonJsonDumps(nlohmann::json(-7), JsonSeparators::kPython), "-7");
  EXPECT_EQ(
      PythonJsonDumps(nlohmann::json(18446744073709551615ULL), JsonSeparators::kPython),
      "18446744073709551615");
}

}  // namespace
}  // namespace tandem::chat
