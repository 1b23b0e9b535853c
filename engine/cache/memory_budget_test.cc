#include "engine/cache/memory_budget.h"

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

struct BytesCase {
  const char* text;
  int64_t bytes;
};

TEST(ParseMemoryBudget, Bytes) {
  const BytesCase cases[] = {
      {"8GiB", int64_t{8} << 30},
      {"8gib", int64_t{8} << 30},
      {"8 GiB", int64_t{8} << 30},
      {"8G", int64_t{8} << 30},
      {"512MiB", int64_t{512} << 20},
      {"512M", int64_t{512} << 20},
      {"1.5GiB", int64_t{3} << 29},
      {"2GB", 2000000000},
      {"3KB", 3000},
      {"3KiB", 3072},
      {"1TiB", int64_t{1} << 40},
      {"100B", 100},
      {"4000000000", 4000000000},
      {"2", 2},
      {" 64MiB ", int64_t{64} << 20},
  };
  for (const BytesCase& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<MemoryBudget> b = ParseMemoryBudget(c.text);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_FALSE(b->is_fraction());
    EXPECT_EQ(b->bytes, c.bytes);
  }
}

TEST(ParseMemoryBudget, Fractions) {
  for (double f : {0.2, 0.9, 1.0, 0.05}) {
    absl::StatusOr<MemoryBudget> b = ParseMemoryBudget(std::to_string(f));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(b->is_fraction());
    EXPECT_DOUBLE_EQ(b->fraction, f);
  }
  absl::StatusOr<MemoryBudget> one = ParseMemoryBudget("1");
  ASSERT_TRUE(one.ok());
  EXPECT_TRUE(one->is_fraction());  // all of it, not one byte
}

TEST(ParseMemoryBudget, BadInputNamesTheText) {
  for (const char* t : {"", "  ", "-1", "0", "0GiB", "1.5", "abc", "8 parsecs", "GiB",
                        "1e9", "0.5.5", "99999999TiB", "+3"}) {
    SCOPED_TRACE(t);
    absl::StatusOr<MemoryBudget> b = ParseMemoryBudget(t);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find(std::string("\"") + t + "\""),
              std::string::npos)
        << b.status();
  }
}

TEST(ResolveMemoryBudget, FractionOfAvailable) {
  MemoryBudget f;
  f.fraction = 0.25;
  EXPECT_EQ(*ResolveMemoryBudget(f, 4000), 1000);
  EXPECT_FALSE(ResolveMemoryBudget(f, 0).ok());
  MemoryBudget b;
  b.bytes = 77;
  EXPECT_EQ(*ResolveMemoryBudget(b, 0), 77);  // bytes need no available size
}

TEST(ReadMemAvailable, ParsesMeminfo) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/meminfo";
  {
    std::ofstream out(path);
    out << "MemTotal:       24000000 kB\nMemFree:        1000 kB\n"
           "MemAvailable:   16777216 kB\nBuffers:        5 kB\n";
  }
  absl::StatusOr<int64_t> a = ReadMemAvailable(path);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, int64_t{16} << 30);
  {
    std::ofstream out(path);
    out << "MemTotal: 5 kB\n";
  }
  EXPECT_EQ(ReadMemAvailable(path).status().code(), absl::StatusCode::kNotFound);
  {
    std::ofstream out(path);
    out << "MemAvailable: lots\n";
  }
  EXPECT_EQ(ReadMemAvailable(path).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(ReadMemAvailable(path + ".missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ReadMemAvailable, ThisHost) {
  absl::StatusOr<int64_t> a = ReadMemAvailable("/proc/meminfo");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GT(*a, 0);
}

TEST(FormatBytes, Units) {
  EXPECT_EQ(FormatBytes(100), "100 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace tandem::engine
