#include "engine/cache/cache_sizing.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

// The tiny K3 checkpoint: 2 MLA layers of (32 + 8) BF16 values per token; 6 KDA
// layers of 4 heads * 16 * 16 fp32 state + 3 * 3 * 64 fp32 conv tails.
CacheSizingInput Tiny(int64_t budget) {
  CacheSizingInput in;
  in.budget_bytes = budget;
  in.token_bytes = 2 * 40 * 2;                             // 160
  in.slot_bytes = 6 * (4 * 16 * 16 * 4 + 3 * 3 * 64 * 4);  // 38,400
  in.block_size = 16;
  in.max_num_seqs = 256;
  in.model_max_len = 1048576;
  return in;
}

TEST(SizeCache, SlotsFirstThenBlocks) {
  absl::StatusOr<CacheSizing> s = SizeCache(Tiny(int64_t{1} << 30));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_slots, 256);
  EXPECT_FALSE(s->slots_limited_by_memory);
  EXPECT_EQ(s->slot_bytes, 256 * 38400);
  EXPECT_EQ(s->num_blocks, ((int64_t{1} << 30) - 256 * 38400) / (160 * 16));
  EXPECT_EQ(s->cache_tokens, s->num_blocks * 16);
  EXPECT_EQ(s->max_model_len, 1048576);
  EXPECT_LE(s->total_bytes(), int64_t{1} << 30);
  EXPECT_GT(s->total_bytes(), (int64_t{1} << 30) - 160 * 16);  // no block left over
}

struct Case {
  const char* name;
  int64_t budget;
  int32_t max_num_seqs;
  int64_t max_model_len;
  int64_t override_blocks;
  // Expected (when ok).
  bool ok;
  int32_t slots;
  int64_t blocks;
  int64_t model_len;
  bool slots_limited;
  bool len_limited;
};

TEST(SizeCache, Table) {
  const int64_t kMiB = int64_t{1} << 20;
  const Case cases[] = {
      // 64 MiB: 256 slots (9.8 MB) fit in half; the rest is blocks.
      {"64MiB", 64 * kMiB, 256, 0, 0, true, 256, (64 * kMiB - 256 * 38400) / 2560,
       (64 * kMiB - 256 * 38400) / 2560 * 16, false, true},
      // Slots capped at half the budget: 4 MiB / 2 / 38,400 = 54.
      {"4MiB", 4 * kMiB, 256, 0, 0, true, 54, (4 * kMiB - 54 * 38400) / 2560,
       (4 * kMiB - 54 * 38400) / 2560 * 16, true, true},
      // An explicit length that fits stays.
      {"len fits", 64 * kMiB, 8, 4096, 0, true, 8, (64 * kMiB - 8 * 38400) / 2560, 4096,
       false, false},
      // An explicit length that does not fit is an error.
      {"len too long", 64 * kMiB, 256, 1048576, 0, false},
      // Above the model's context.
      {"len above model", int64_t{1} << 34, 1, 2097152, 0, false},
      // The block override wins over the budget.
      {"override", 64 * kMiB, 4, 512, 100, true, 4, 100, 512, false, false},
      {"override short", 64 * kMiB, 4, 0, 10, true, 4, 10, 160, false, true},
      // Too small for one slot.
      {"no slot", 1000, 256, 0, 0, false},
      {"zero seqs", 64 * kMiB, 0, 0, 0, false},
      {"len 1", 64 * kMiB, 4, 1, 0, false},
      {"no budget", 0, 4, 0, 0, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    CacheSizingInput in = Tiny(c.budget);
    in.max_num_seqs = c.max_num_seqs;
    in.max_model_len = c.max_model_len;
    in.num_blocks_override = c.override_blocks;
    absl::StatusOr<CacheSizing> s = SizeCache(in);
    ASSERT_EQ(s.ok(), c.ok) << (s.ok() ? s->Summary() : s.status().ToString());
    if (!c.ok) {
      EXPECT_FALSE(s.status().message().empty());
      continue;
    }
    EXPECT_EQ(s->num_slots, c.slots);
    EXPECT_EQ(s->num_blocks, c.blocks);
    EXPECT_EQ(s->max_model_len, c.model_len);
    EXPECT_EQ(s->slots_limited_by_memory, c.slots_limited);
    EXPECT_EQ(s->max_model_len_limited_by_memory, c.len_limited);
  }
}

TEST(SizeCache, ErrorsSayWhatToChange) {
  CacheSizingInput in = Tiny(int64_t{64} << 20);
  in.max_model_len = 1048576;
  absl::Status s = SizeCache(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--kv_cache_memory"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--max_model_len 1048576"), std::string::npos) << s;
  in = Tiny(1000);
  s = SizeCache(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--kv_cache_memory"), std::string::npos) << s;
}

TEST(SizeCache, BlocksCappedAtInt32) {
  CacheSizingInput in = Tiny(int64_t{1} << 50);
  absl::StatusOr<CacheSizing> s = SizeCache(in);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_blocks, 2147483647);
}

TEST(SizeCache, SummaryNamesTheNumbers) {
  absl::StatusOr<CacheSizing> s = SizeCache(Tiny(int64_t{64} << 20));
  ASSERT_TRUE(s.ok());
  const std::string line = s->Summary();
  EXPECT_NE(line.find("256 KDA slots"), std::string::npos) << line;
  EXPECT_NE(line.find(absl::StrCat(s->num_blocks, " MLA blocks")), std::string::npos);
  EXPECT_NE(line.find("64.00 MiB budget"), std::string::npos) << line;
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

TEST(CacheSizingSnapshotsTest, SnapshotShareComesOutOfTheBlocks) {
  CacheSizingInput in;
  in.budget_bytes = 100 << 20;
  in.token_bytes = 160;
  in.slot_bytes = 38400;
  in.block_size = 16;
  in.max_num_seqs = 16;
  in.model_max_len = 1 << 20;
  auto plain = SizeCache(in);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->num_snapshots, 0);
  in.snapshot_fraction = 0.1;
  auto with = SizeCache(in);
  ASSERT_TRUE(with.ok());
  EXPECT_EQ(with->num_snapshots, (10485760) / 38400);  // 273
  EXPECT_EQ(with->num_slots, 16);
  EXPECT_EQ(with->slot_bytes, (16 + 273) * 38400);
  EXPECT_EQ(with->num_blocks, (in.budget_bytes - with->slot_bytes) / (160 * 16));
  EXPECT_LE(with->total_bytes(), in.budget_bytes);
  in.snapshot_fraction = 0.95;
  EXPECT_FALSE(SizeCache(in).ok());
}

}  // namespace
}  // namespace tandem::engine
