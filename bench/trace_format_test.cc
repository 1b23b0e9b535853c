#include "bench/trace_format.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::bench {
namespace {

using ::testing::HasSubstr;

TEST(TraceFormatTest, ParsesAMooncakeLine) {
  auto r = ParseTraceLine(
      R"({"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]})",
      1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->timestamp_ms, 3052);
  EXPECT_EQ(r->input_length, 2287);
  EXPECT_EQ(r->output_length, 316);
  EXPECT_EQ(r->hash_ids, (std::vector<int64_t>{0, 42, 43, 44, 45}));
}

TEST(TraceFormatTest, AcceptsFractionalTimestampsAndExtraFields) {
  auto r = ParseTraceLine(
      R"({"timestamp": 1.5, "input_length": 512, "output_length": 1, "hash_ids": [7], "x": 1})",
      1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->timestamp_ms, 1.5);
  EXPECT_EQ(r->hash_ids.size(), 1u);
}

void ExpectLineError(const std::string& text, int line, const std::string& what) {
  auto r = ParseTrace(text);
  ASSERT_FALSE(r.ok()) << text;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("line " + std::to_string(line) + ": "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(what));
}

TEST(TraceFormatTest, BadLinesNameTheLine) {
  const std::string good =
      R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})"
      "\n";
  ExpectLineError(good + "{not json\n", 2, "not valid JSON");
  ExpectLineError(good + "\n[1, 2]\n", 3, "not a JSON object");
  ExpectLineError(good + R"({"timestamp": 1, "output_length": 5, "hash_ids": [1]})", 2,
                  "missing \"input_length\"");
  ExpectLineError(R"({"input_length": 5, "output_length": 5, "hash_ids": [1]})", 1,
                  "missing \"timestamp\"");
  ExpectLineError(
      R"({"timestamp": -1, "input_length": 5, "output_length": 5, "hash_ids": [1]})", 1,
      "\"timestamp\" must be a number >= 0");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []})", 1,
      "\"input_length\" must be a whole number >= 1");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 5.5, "output_length": 5, "hash_ids": [1]})",
      1, "\"input_length\" must be a whole number >= 1");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [1]})", 1,
      "\"output_length\" must be a whole number >= 1");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3})", 1,
      "\"hash_ids\" must be an array");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]})",
      1, "\"hash_ids\"[1] is not a whole number >= 0");
  // 600 tokens are two 512-token blocks.
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]})",
      1, "input_length 600 needs 2 hash_ids of 512 tokens, got 1");
  ExpectLineError(
      R"({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]})",
      1, "needs 1 hash_ids");
  ExpectLineError(
      good + "\n" +
          R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})" +
          "\n" +
          R"({"timestamp": -0.5, "input_length": 5, "output_length": 1, "hash_ids": [1]})",
      4, "\"timestamp\" must be");
}

TEST(TraceFormatTest, TimestampsMustNotDecrease) {
  ExpectLineError(
      R"({"timestamp": 10, "input_length": 5, "output_length": 1, "hash_ids": [1]})"
      "\n"
      R"({"timestamp": 10, "input_length": 5, "output_length": 1, "hash_ids": [1]})"
      "\n"
      R"({"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [1]})",
      3, "is before the previous line's 10");
}

TEST(TraceFormatTest, EmptyTraceIsAnError) {
  auto r = ParseTrace("\n  \n");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no requests"));
}

TEST(TraceFormatTest, BlankLinesAndCrlfAreSkipped) {
  auto r = ParseTrace(
      "\r\n"
      R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})"
      "\r\n\n"
      R"({"timestamp": 4, "input_length": 1025, "output_length": 2, "hash_ids": [1, 2, 3]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[1].hash_ids, (std::vector<int64_t>{1, 2, 3}));
}

TEST(TraceFormatTest, WriteThenReadRoundTrips) {
  std::vector<TraceRecord> in = {
      {0, 600, 10, {0, 1}}, {250.5, 512, 3, {0}}, {1000, 2000, 7, {0, 2, 3, 4}}};
  EXPECT_EQ(
      FormatTraceLine(in[0]),
      R"({"timestamp":0,"input_length":600,"output_length":10,"hash_ids":[0,1]})");
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/t.jsonl";
  ASSERT_TRUE(WriteTraceFile(path, in).ok());
  auto out = ReadTraceFile(path);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ((*out)[i].timestamp_ms, in[i].timestamp_ms);
    EXPECT_EQ((*out)[i].input_length, in[i].input_length);
    EXPECT_EQ((*out)[i].output_length, in[i].output_length);
    EXPECT_EQ((*out)[i].hash_ids, in[i].hash_ids);
  }
  auto missing = ReadTraceFile(path + ".absent");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(TraceFormatTest, FileErrorsNameTheFileAndLine) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/bad.jsonl";
  std::vector<TraceRecord> in = {{0, 5, 1, {0}}};
  ASSERT_TRUE(WriteTraceFile(path, in).ok());
  {
    FILE* f = fopen(path.c_str(), "a");
    fputs("{\"timestamp\": 1}\n", f);
    fclose(f);
  }
  auto r = ReadTraceFile(path);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(path + ": line 2: missing"));
}

}  // namespace
}  // namespace tandem::bench
