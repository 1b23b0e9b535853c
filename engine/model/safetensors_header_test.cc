#include "engine/model/safetensors_header.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::model {
namespace {

using ::testing::HasSubstr;

// 8-byte length + `json` + `data_bytes` zero bytes.
std::string File(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;
  out += std::string(data_bytes, '\0');
  return out;
}

absl::StatusOr<SafetensorsHeader> Parse(const std::string& json, size_t data_bytes) {
  std::string f = File(json, data_bytes);
  return ParseSafetensorsHeader(f, f.size());
}

TEST(DTypeTest, NamesAndSizesRoundTrip) {
  const std::pair<const char*, size_t> cases[] = {
      {"BF16", 2}, {"F16", 2}, {"F32", 4}, {"U8", 1},  {"F8_E4M3", 1},
      {"I8", 1},   {"I32", 4}, {"I64", 8}, {"F64", 8}, {"BOOL", 1}};
  for (const auto& [name, size] : cases) {
    DType d;
    ASSERT_TRUE(ParseDType(name, &d)) << name;
    EXPECT_EQ(DTypeName(d), name);
    EXPECT_EQ(DTypeSize(d), size) << name;
  }
  DType d;
  EXPECT_FALSE(ParseDType("bf16", &d));
  EXPECT_FALSE(ParseDType("Q4_K", &d));
}

TEST(SafetensorsHeaderTest, ParsesValidHeaderSortedWithMetadata) {
  auto h = Parse(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
                 R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                 R"("__metadata__":{"format":"pt"}})",
                 12);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->tensors[1].begin, 4u);
  EXPECT_EQ(h->tensors[1].end, 12u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->data_bytes, 12u);
}

TEST(SafetensorsHeaderTest, AllowsGapsAndEmptyTensorsAndScalars) {
  auto h = Parse(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("z":{"dtype":"F32","shape":[0,5],"data_offsets":[2,2]},)"
                 R"("s":{"dtype":"F32","shape":[],"data_offsets":[4,8]}})",
                 16);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 3u);
}

TEST(SafetensorsHeaderTest, SerializeRoundTripsAndPadsToEight) {
  std::vector<TensorEntry> entries = {{"w", DType::kBF16, {3, 2}, 0, 12},
                                      {"b", DType::kF32, {3}, 12, 24}};
  std::string header = SerializeSafetensorsHeader(entries, {{"format", "pt"}});
  EXPECT_EQ(header.size() % 8, 0u);
  std::string file = header + std::string(24, '\0');
  auto h = ParseSafetensorsHeader(file, file.size());
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0], (TensorEntry{"b", DType::kF32, {3}, 12, 24}));
  EXPECT_EQ(h->tensors[1], (TensorEntry{"w", DType::kBF16, {3, 2}, 0, 12}));
  // Deterministic.
  EXPECT_EQ(header, SerializeSafetensorsHeader(entries, {{"format", "pt"}}));
}

struct BadCase {
  const char* label;
  std::string json;
  size_t data_bytes;
  const char* message;
};

class BadHeaderTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadHeaderTest, IsRejectedWithMessage) {
  const BadCase& c = GetParam();
  auto h = Parse(c.json, c.data_bytes);
  ASSERT_FALSE(h.ok()) << c.label;
  EXPECT_THAT(std::string(h.status().message()), HasSubstr(c.message)) << c.label;
}

INSTANTIATE_TEST_SUITE_P(
    All, BadHeaderTest,
    ::testing::Values(
        BadCase{"not json", "{nope", 0, "does not parse"},
        BadCase{"array", "[1,2]", 0, "not an object"},
        BadCase{"entry not object", R"({"a":3})", 0,
                "tensor 'a': entry is not an object"},
        BadCase{"missing dtype", R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1,
                "missing \"dtype\""},
        BadCase{"unknown dtype",
                R"({"a":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", 1,
                "unknown dtype \"Q8\""},
        BadCase{"dtype not string",
                R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", 1,
                "\"dtype\" is not a string"},
        BadCase{"missing shape", R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1,
                "missing \"shape\""},
        BadCase{"negative dim",
                R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1,
                "non-negative integer"},
        BadCase{"float dim",
                R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1,
                "non-negative integer"},
        BadCase{"missing offsets", R"({"a":{"dtype":"U8","shape":[1]}})", 1,
                "missing \"data_offsets\""},
        BadCase{"three offsets",
                R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 2,
                "[begin, end]"},
        BadCase{"end before begin",
                R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", 2,
                "end 1 < begin 2"},
        BadCase{"past buffer",
                R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 3,
                "beyond the data buffer"},
        BadCase{"wrong nbytes",
                R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4,
                "needs 8"},
        BadCase{
            "overflowing shape",
            R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
            4, "overflows"},
        BadCase{"overlap",
                R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                6, "overlap"},
        BadCase{"duplicate key",
                R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                2, "appears twice"},
        BadCase{"metadata not strings", R"({"__metadata__":{"format":1}})", 0,
                "is not a string"},
        BadCase{"metadata not object", R"({"__metadata__":[]})", 0, "not an object"},
        BadCase{"extra field",
                R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1,
                "unknown field \"x\""},
        BadCase{"deep nesting", R"({"__metadata__":{"a":[[[[[[[[[[1]]]]]]]]]]}})", 0,
                "nesting"}),
    [](const ::testing::TestParamInfo<BadCase>& info) {
      std::string s = info.param.label;
      for (char& c : s) {
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return s;
    });

TEST(SafetensorsHeaderTest, RejectsBadLengthPrefix) {
  // Shorter than 8 bytes.
  EXPECT_FALSE(ParseSafetensorsHeader("abc", 3).ok());
  // Length beyond the file.
  std::string f = File("{}", 0);
  f[0] = 100;
  auto h = ParseSafetensorsHeader(f, f.size());
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("past the end"));
  // Length beyond the 100 MB cap, even if the file claims to be that big.
  std::string big(8, '\0');
  big[4] = 1;  // 2^32
  h = ParseSafetensorsHeader(big, 1ull << 40);
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("exceeds the limit"));
  // Header present in the file but not in the given bytes.
  std::string g = File("{}", 0);
  h = ParseSafetensorsHeader(absl::string_view(g).substr(0, 9), g.size());
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("were given"));
}

TEST(SafetensorsHeaderTest, TrailingSpacesInHeaderAreAccepted) {
  auto h = Parse(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}     )", 1);
  ASSERT_TRUE(h.ok()) << h.status();
}

}  // namespace
}  // namespace tandem::model
