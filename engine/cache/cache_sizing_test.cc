#include "engine/cache/cache_sizing.h"

#include <string>
#include <vector>

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
      // An explicit length that fits only beside fewer slots: 218 slots (half
      // the budget) leave 3283 blocks; 65536 tokens need 4096, so (16 MiB -
      // 4096 * 2560) / 38400 = 163 slots, leaving 4108 blocks.
      {"len fits with fewer slots", 16 * kMiB, 256, 65536, 0, true, 163,
       (16 * kMiB - 163 * 38400) / 2560, 65536, true, false},
      // The model's context (1M tokens: 65536 blocks of 2560 bytes) before the
      // last slots: 256 would leave 64972 blocks; (168 MiB - 65536 * 2560) /
      // 38400 = 218 slots leave 65542.
      {"model len over slots", 168 * kMiB, 256, 0, 0, true, 218,
       (168 * kMiB - 218 * 38400) / 2560, 1048576, true, false},
      // 170 MiB: 256 slots and 65792 blocks already hold it.
      {"model len fits", 170 * kMiB, 256, 0, 0, true, 256,
       (170 * kMiB - 256 * 38400) / 2560, 1048576, false, false},
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

namespace tandem::engine {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

DeviceMemoryMeasure Dev(int64_t total, int64_t in_use, int64_t peak,
                        int64_t free = -1) {
  DeviceMemoryMeasure d;
  d.device = "cuda_sim";
  d.total_bytes = total;
  d.in_use_bytes = in_use;
  d.weights_bytes = in_use - 4 * kMiB;
  d.activation_peak_bytes = peak;
  d.free_bytes = free >= 0 ? free : total - in_use;
  return d;
}

struct DeviceCase {
  const char* name;
  std::vector<DeviceMemoryMeasure> devices;
  double utilization;
  const char* kv_cache_memory;  // "" : by utilization
  // Expected.
  absl::StatusCode code;
  int64_t budget;  // the worker's (all devices)
  int32_t slots;
  int64_t blocks;
  int64_t max_model_len;
  bool len_limited;
  bool free_limited;
  const char* message;  // a part of the error
};

// Device capacity, utilization, what the weights and other buffers hold, the
// profiling forward's peak -> the budget, then SizeCache over the tiny model's
// per-token and per-sequence sizes (Tiny above).
TEST(ResolveDeviceBudget, Table) {
  const int64_t kFloor09 = 966367641;  // floor(0.9 GiB)
  const DeviceCase cases[] = {
      {"0.9 of 1 GiB",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.9,
       "",
       absl::StatusCode::kOk,
       630823321,  // 966367641 - 300 MiB - 20 MiB
       256,
       242575,  // (630823321 - 256 * 38400) / 2560
       1048576,
       false,
       false,
       ""},
      {"0.5 of 1 GiB",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.5,
       "",
       absl::StatusCode::kOk,
       192 * kMiB,
       256,
       74803,
       1048576,
       false,
       false,
       ""},
      {"10 MiB left: slots and length limited",
       {Dev(kGiB, kFloor09 - 30 * kMiB, 20 * kMiB)},
       0.9,
       "",
       absl::StatusCode::kOk,
       10 * kMiB,
       136,   // half of 10 MiB / 38,400
       2056,  // (10 MiB - 136 * 38400) / 2560
       32896,
       true,
       false,
       ""},
      {"two ranks: twice the smaller device's",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB), Dev(kGiB, 310 * kMiB, 20 * kMiB)},
       0.9,
       "",
       absl::StatusCode::kOk,
       2 * int64_t{620337561},
       256,
       480798,
       1048576,
       false,
       false,
       ""},
      {"--kv_cache_memory bytes override",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB), Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.9,
       "64MiB",
       absl::StatusCode::kOk,
       64 * kMiB,
       256,
       22374,
       357984,
       true,
       false,
       ""},
      {"--kv_cache_memory fraction of what is left",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.9,
       "0.5",
       absl::StatusCode::kOk,
       369098752,  // (1 GiB - 320 MiB) / 2
       256,
       140339,
       1048576,
       false,
       false,
       ""},
      {"another process holds memory: lowered to what is free",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB, 400 * kMiB)},
       0.9,
       "",
       absl::StatusCode::kOk,
       397410304,  // 400 MiB free - 20 MiB peak - 1 MiB slack
       256,
       151398,
       1048576,
       false,
       true,
       ""},
      {"utilization too low for the weights and the profile",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.3,
       "",
       absl::StatusCode::kResourceExhausted,
       0,
       0,
       0,
       0,
       false,
       false,
       "raise --gpu_memory_utilization to at least 0.3126"},
      {"weights larger than the device",
       {Dev(kGiB, kGiB - kMiB, 20 * kMiB, kMiB)},
       1.0,
       "",
       absl::StatusCode::kResourceExhausted,
       0,
       0,
       0,
       0,
       false,
       false,
       "more than the device has"},
      {"too little free beside another process",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB, 21 * kMiB)},
       0.9,
       "",
       absl::StatusCode::kResourceExhausted,
       0,
       0,
       0,
       0,
       false,
       false,
       "has only 21.00 MiB free"},
      {"--kv_cache_memory bytes above what is free: not lowered",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB, 400 * kMiB)},
       0.9,
       "512MiB",
       absl::StatusCode::kResourceExhausted,
       0,
       0,
       0,
       0,
       false,
       false,
       "has only 400.00 MiB free"},
      {"--kv_cache_memory bytes below one block and one slot",
       {Dev(kGiB, 300 * kMiB, 20 * kMiB)},
       0.9,
       "1000",
       absl::StatusCode::kResourceExhausted,
       0,
       0,
       0,
       0,
       false,
       false,
       "one MLA block and one KDA slot need 75.00 KiB"},
      {"utilization 0",
       {Dev(kGiB, 0, 0)},
       0.0,
       "",
       absl::StatusCode::kInvalidArgument,
       0,
       0,
       0,
       0,
       false,
       false,
       "--gpu_memory_utilization must be in (0, 1]"},
      {"utilization above 1",
       {Dev(kGiB, 0, 0)},
       1.5,
       "",
       absl::StatusCode::kInvalidArgument,
       0,
       0,
       0,
       0,
       false,
       false,
       "--gpu_memory_utilization must be in (0, 1]"},
      {"no capacity",
       {Dev(0, 0, 0, 0)},
       0.9,
       "",
       absl::StatusCode::kInvalidArgument,
       0,
       0,
       0,
       0,
       false,
       false,
       "capacity of 0"},
      {"no device",
       {},
       0.9,
       "",
       absl::StatusCode::kInvalidArgument,
       0,
       0,
       0,
       0,
       false,
       false,
       "at least one device"},
  };
  for (const DeviceCase& c : cases) {
    SCOPED_TRACE(c.name);
    CacheSizingInput cache = Tiny(0);
    DeviceBudgetInput in;
    in.devices = c.devices;
    in.utilization = c.utilization;
    in.profile_tokens = 256;
    in.min_cache_bytes = MinCacheBytes(cache);
    if (*c.kv_cache_memory != '\0') {
      absl::StatusOr<MemoryBudget> b = ParseMemoryBudget(c.kv_cache_memory);
      ASSERT_TRUE(b.ok()) << b.status();
      in.has_kv_cache_memory = true;
      in.kv_cache_memory = *b;
      in.kv_cache_memory_text = c.kv_cache_memory;
    }
    absl::StatusOr<DeviceMemoryUse> u = ResolveDeviceBudget(in);
    ASSERT_EQ(u.status().code(), c.code) << u.status();
    if (!u.ok()) {
      EXPECT_NE(u.status().message().find(c.message), std::string::npos) << u.status();
      continue;
    }
    EXPECT_EQ(u->budget_bytes, c.budget);
    EXPECT_EQ(u->budget_per_device_bytes * u->num_devices, c.budget);
    EXPECT_EQ(u->num_devices, static_cast<int>(c.devices.size()));
    EXPECT_EQ(u->limited_by_free_memory, c.free_limited);
    cache.budget_bytes = u->budget_bytes;
    absl::StatusOr<CacheSizing> s = SizeCache(cache);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->num_slots, c.slots);
    EXPECT_EQ(s->num_blocks, c.blocks);
    EXPECT_EQ(s->max_model_len, c.max_model_len);
    EXPECT_EQ(s->max_model_len_limited_by_memory, c.len_limited);
    // What the cache takes never exceeds the per-device share it was given.
    EXPECT_LE(s->total_bytes(), u->budget_bytes);
  }
}

TEST(ResolveDeviceBudget, ErrorNamesTheDeviceAndTheParts) {
  DeviceBudgetInput in;
  in.devices = {Dev(kGiB, 300 * kMiB, 20 * kMiB)};
  in.devices[0].weights_bytes = 296 * kMiB;
  in.utilization = 0.25;
  in.profile_tokens = 512;
  in.min_cache_bytes = MinCacheBytes(Tiny(0));
  absl::Status s = ResolveDeviceBudget(in).status();
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  for (const char* part :
       {"--gpu_memory_utilization=0.25", "cuda_sim (1.00 GiB",
        "weights take 296.00 MiB", "other buffers 4.00 MiB", "at 512 tokens 20.00 MiB",
        "needs at least 320.07 MiB of each device"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << ": " << s;
  }
}

TEST(ResolveDeviceBudget, MinCacheBytesIsOneBlockAndOneSlot) {
  CacheSizingInput in = Tiny(0);
  EXPECT_EQ(MinCacheBytes(in), 2 * 38400);  // the slot's half-budget rule binds
  in.slot_bytes = 100;
  EXPECT_EQ(MinCacheBytes(in), 100 + 16 * 160);
  // The minimum is enough, and a byte less is not.
  in = Tiny(MinCacheBytes(Tiny(0)));
  EXPECT_TRUE(SizeCache(in).ok());
  in.budget_bytes -= 1;
  EXPECT_FALSE(SizeCache(in).ok());
}

}  // namespace
}  // namespace tandem::engine
