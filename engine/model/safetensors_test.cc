#include "engine/model/safetensors.h"

#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::string F32(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.begin(), s.size());
  return s;
}

std::vector<TensorData> Sample() {
  return {
      TensorData{"w.bf16",
                 DType::kBF16,
                 {2, 2},
                 std::string("\x80\x3f\x00\x40\x40\x40\x80\x40", 8)},
      TensorData{"b.f32", DType::kF32, {3}, F32({1.5f, -2.0f, 0.25f})},
      TensorData{"q.u8", DType::kU8, {3}, std::string("\x01\x02\x03", 3)},
      TensorData{"h.f16", DType::kF16, {1}, std::string("\x00\x3c", 2)},
  };
}

TEST(SafetensorsTest, WriteThenReadSingleFile) {
  const std::string path = TempDir("single") + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Sample()).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->header().metadata.at("format"), "pt");
  EXPECT_EQ((*file)->header().data_start % 8, 0u);
  ASSERT_EQ((*file)->header().tensors.size(), 4u);

  auto set = SafetensorsSet::OpenFile(path);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->Names(),
            (std::vector<std::string>{"b.f32", "h.f16", "q.u8", "w.bf16"}));
  auto b = (*set)->Get("b.f32");
  ASSERT_TRUE(b.ok());
  auto f32 = b->F32();
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(std::vector<float>(f32->begin(), f32->end()),
            (std::vector<float>{1.5f, -2.0f, 0.25f}));
  EXPECT_EQ(b->ShapeString(), "[3]");
  auto w = (*set)->Get("w.bf16");
  ASSERT_TRUE(w.ok());
  auto wf = w->ToFloat();
  ASSERT_TRUE(wf.ok());
  EXPECT_EQ(*wf, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
  EXPECT_FALSE(w->F32().ok());  // wrong dtype
  auto h = (*set)->Get("h.f16");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->ToFloat()->at(0), 1.0f);
  auto q = (*set)->Get("q.u8");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->U8()->at(2), 3);
  EXPECT_FALSE(q->ToFloat().ok());
  auto missing = (*set)->Get("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("'nope'"));
  // Zero-copy: the view points into the mapping, at the header's offset.
  const TensorEntry* e = (*file)->Find("b.f32");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(std::memcmp((*file)->View(*e).data, F32({1.5f, -2.0f, 0.25f}).data(), 12),
            0);
}

TEST(SafetensorsTest, PopulatedMappingReadsTheSameBytes) {
  const std::string path = TempDir("populate") + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Sample()).ok());
  MapOptions populate;
  populate.populate = true;
  auto lazy = SafetensorsSet::OpenFile(path);
  auto eager = SafetensorsSet::OpenFile(path, populate);
  ASSERT_TRUE(lazy.ok() && eager.ok());
  for (const std::string& name : (*lazy)->Names()) {
    auto a = (*lazy)->Get(name);
    auto b = (*eager)->Get(name);
    ASSERT_EQ(a->nbytes, b->nbytes);
    EXPECT_EQ(std::memcmp(a->data, b->data, a->nbytes), 0) << name;
    EXPECT_NE(a->data, b->data);  // two mappings
  }
}

TEST(SafetensorsTest, WriterIsDeterministicAndAligned) {
  const std::string dir = TempDir("det");
  auto tensors = Sample();
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", tensors).ok());
  std::reverse(tensors.begin(), tensors.end());
  ASSERT_TRUE(WriteSafetensors(dir + "/b.safetensors", tensors).ok());
  EXPECT_EQ(ReadAll(dir + "/a.safetensors"), ReadAll(dir + "/b.safetensors"));
  auto set = SafetensorsSet::OpenFile(dir + "/a.safetensors");
  ASSERT_TRUE(set.ok());
  for (const std::string& name : (*set)->Names()) {
    auto v = (*set)->Get(name);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v->data) % DTypeSize(v->dtype), 0u) << name;
  }
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  const std::string dir = TempDir("bad_write");
  auto t = Sample();
  t.push_back(t[0]);
  auto s = WriteSafetensors(dir + "/x.safetensors", t);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w.bf16' given twice"));
  std::vector<TensorData> wrong = {TensorData{"a", DType::kF32, {2}, "abc"}};
  s = WriteSafetensors(dir + "/y.safetensors", wrong);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("shape needs 8"));
}

// Two shards and an index.
std::string MakeSharded(const std::string& name, const nlohmann::json& weight_map) {
  const std::string dir = TempDir(name);
  auto t = Sample();
  EXPECT_TRUE(WriteSafetensors(dir + "/s1.safetensors", {t[0], t[1]}).ok());
  EXPECT_TRUE(WriteSafetensors(dir + "/s2.safetensors", {t[2], t[3]}).ok());
  nlohmann::json index = {{"metadata", {{"total_size", 25}}},
                          {"weight_map", weight_map}};
  WriteAll(dir + "/model.safetensors.index.json", index.dump());
  return dir;
}

nlohmann::json GoodMap() {
  return {{"w.bf16", "s1.safetensors"},
          {"b.f32", "s1.safetensors"},
          {"q.u8", "s2.safetensors"},
          {"h.f16", "s2.safetensors"}};
}

TEST(SafetensorsTest, ShardedDirectory) {
  const std::string dir = MakeSharded("sharded", GoodMap());
  auto set = SafetensorsSet::OpenDirectory(dir);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->size(), 4u);
  EXPECT_EQ((*set)->files().size(), 2u);
  auto q = (*set)->Get("q.u8");
  ASSERT_TRUE(q.ok());
  EXPECT_THAT(q->file, HasSubstr("s2.safetensors"));
  EXPECT_EQ((*set)->total_tensor_bytes(), 8u + 12u + 3u + 2u);
}

TEST(SafetensorsTest, IndexNamingMissingShard) {
  auto map = GoodMap();
  map["q.u8"] = "s3.safetensors";
  const std::string dir = MakeSharded("missing_shard", map);
  auto set = SafetensorsSet::OpenDirectory(dir);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(std::string(set.status().message()), HasSubstr("shard s3.safetensors"));
  EXPECT_THAT(std::string(set.status().message()), HasSubstr("'q.u8'"));
}

TEST(SafetensorsTest, IndexTensorAbsentFromShard) {
  auto map = GoodMap();
  map["ghost"] = "s1.safetensors";
  const std::string dir = MakeSharded("ghost", map);
  auto set = SafetensorsSet::OpenDirectory(dir);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(std::string(set.status().message()), HasSubstr("'ghost'"));
  EXPECT_THAT(std::string(set.status().message()), HasSubstr("s1.safetensors"));
}

TEST(SafetensorsTest, ShardTensorNotInIndex) {
  auto map = GoodMap();
  map.erase("h.f16");
  const std::string dir = MakeSharded("unlisted", map);
  auto set = SafetensorsSet::OpenDirectory(dir);
  ASSERT_FALSE(set.ok());
  EXPECT_THAT(std::string(set.status().message()), HasSubstr("'h.f16' is not listed"));
}

TEST(SafetensorsTest, BadIndexFiles) {
  const std::string dir = TempDir("bad_index");
  WriteAll(dir + "/model.safetensors.index.json", "{not json");
  EXPECT_THAT(std::string(SafetensorsSet::OpenDirectory(dir).status().message()),
              HasSubstr("does not parse"));
  WriteAll(dir + "/model.safetensors.index.json", R"({"weight_map": []})");
  EXPECT_THAT(std::string(SafetensorsSet::OpenDirectory(dir).status().message()),
              HasSubstr("weight_map"));
  WriteAll(dir + "/model.safetensors.index.json",
           R"({"weight_map": {"a": "../etc/passwd"}})");
  EXPECT_THAT(std::string(SafetensorsSet::OpenDirectory(dir).status().message()),
              HasSubstr("not a plain file name"));
  WriteAll(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  EXPECT_FALSE(SafetensorsSet::OpenDirectory(dir).ok());
}

TEST(SafetensorsTest, EmptyDirectoryAndCorruptFiles) {
  const std::string dir = TempDir("empty");
  auto set = SafetensorsSet::OpenDirectory(dir);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kNotFound);

  const std::string path = TempDir("corrupt") + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Sample()).ok());
  std::string bytes = ReadAll(path);
  // Truncate into the data buffer: the last tensor's end is now out of range.
  WriteAll(path, bytes.substr(0, bytes.size() - 1));
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(file.status().message()),
              HasSubstr("beyond the data buffer"));
  // Empty file.
  WriteAll(path, "");
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());
  // Garbage prefix.
  WriteAll(path, std::string("\xff\xff\xff\xff\xff\xff\xff\xff{}", 10));
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());
  EXPECT_FALSE(SafetensorsFile::Open(dir + "/nope.safetensors").ok());
}

}  // namespace
}  // namespace tandem::model
