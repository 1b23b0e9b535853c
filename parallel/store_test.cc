#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "parallel/file_store.h"
#include "parallel/memory_store.h"

namespace tandem::parallel {
namespace {

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/store_test_", name, "_",
                                 absl::ToUnixNanos(absl::Now()));
  std::filesystem::remove_all(dir);
  return dir;
}

// Both stores obey the same contract.
enum class Kind { kMemory, kFile };

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::kMemory) {
      store_ = std::make_unique<MemoryStore>();
    } else {
      store_ = std::make_unique<FileStore>(FreshDir("contract"));
    }
  }
  std::unique_ptr<Store> store_;
};

TEST_P(StoreTest, SetThenGetReturnsTheValue) {
  const std::string binary("a\0b\xff", 4);
  ASSERT_TRUE(store_->Set("g/key", binary).ok());
  absl::StatusOr<std::string> v = store_->Get("g/key", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, binary);
}

TEST_P(StoreTest, SetOverwrites) {
  ASSERT_TRUE(store_->Set("k", "one").ok());
  ASSERT_TRUE(store_->Set("k", "two").ok());
  EXPECT_EQ(*store_->Get("k", absl::Seconds(1)), "two");
}

TEST_P(StoreTest, EmptyValueIsAValue) {
  ASSERT_TRUE(store_->Set("empty", "").ok());
  absl::StatusOr<std::string> v = store_->Get("empty", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "");
}

TEST_P(StoreTest, MissingKeyTimesOutNamingTheKey) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v = store_->Get("never/set", absl::Milliseconds(50));
  const absl::Duration waited = absl::Now() - start;
  ASSERT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("never/set"), std::string::npos);
  EXPECT_GE(waited, absl::Milliseconds(50));
  EXPECT_LT(waited, absl::Seconds(5));
}

TEST_P(StoreTest, GetWaitsForALaterSet) {
  // The reader starts first and must see the writer's value.
  absl::StatusOr<std::string> got;
  std::thread reader([&] { got = store_->Get("late", absl::Seconds(20)); });
  ASSERT_TRUE(store_->Set("late", "value").ok());
  reader.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "value");
}

TEST_P(StoreTest, KeysAreDistinct) {
  // Keys that a naive file-name mapping would merge.
  const std::vector<std::string> keys = {"a/b", "a_b", "a%2Fb",   ".",
                                         "..",  "",    ".hidden", "a b"};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(store_->Set(keys[i], absl::StrCat("v", i)).ok()) << keys[i];
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<std::string> v = store_->Get(keys[i], absl::Seconds(1));
    ASSERT_TRUE(v.ok()) << keys[i] << ": " << v.status();
    EXPECT_EQ(*v, absl::StrCat("v", i)) << keys[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest,
                         ::testing::Values(Kind::kMemory, Kind::kFile),
                         [](const auto& info) {
                           return info.param == Kind::kMemory ? "Memory" : "File";
                         });

TEST(FileStoreTest, TwoInstancesOnOneDirectoryShareKeys) {
  // Processes on one host each open their own FileStore on the directory.
  const std::string dir = FreshDir("shared");
  FileStore a(dir), b(dir);
  ASSERT_TRUE(a.Set("rank_0", "addr0").ok());
  absl::StatusOr<std::string> v = b.Get("rank_0", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr0");
}

TEST(FileStoreTest, PathOfEscapesSeparators) {
  FileStore s("/d");
  EXPECT_EQ(s.PathOf("tp/rank_0"), "/d/tp%2Frank_0");
  EXPECT_EQ(s.PathOf(".."), "/d/%..");
  EXPECT_EQ(s.PathOf(""), "/d/%");
}

TEST(FileStoreTest, UnwritableDirectoryIsAnError) {
  FileStore s("/proc/self/no_such_dir/store");
  EXPECT_FALSE(s.Set("k", "v").ok());
}

}  // namespace
}  // namespace tandem::parallel
