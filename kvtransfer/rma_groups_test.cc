#include "kvtransfer/rma_groups.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

void* Desc(int i) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + i));
}

// The (address, key/desc) of every byte, in order, as the pieces name them and
// as the groups' local and remote lists name them: they must be the same.
struct Byte {
  uint64_t addr;
  uint64_t tag;
  friend bool operator==(const Byte&, const Byte&) = default;
};

void ExpectSameBytes(const std::vector<RmaPiece>& pieces,
                     const std::vector<RmaGroup>& groups) {
  std::vector<Byte> want_local, want_remote, got_local, got_remote;
  for (const RmaPiece& p : pieces) {
    for (uint64_t i = 0; i < p.length; ++i) {
      want_local.push_back({p.local + i, reinterpret_cast<uintptr_t>(p.desc)});
      want_remote.push_back({p.remote + i, p.key});
    }
  }
  int pieces_seen = 0;
  for (const RmaGroup& g : groups) {
    uint64_t local_bytes = 0, remote_bytes = 0;
    for (const auto& l : g.local) {
      for (uint64_t i = 0; i < l.length; ++i)
        got_local.push_back({l.addr + i, reinterpret_cast<uintptr_t>(l.desc)});
      local_bytes += l.length;
    }
    for (const auto& r : g.remote) {
      for (uint64_t i = 0; i < r.length; ++i) got_remote.push_back({r.addr + i, r.key});
      remote_bytes += r.length;
    }
    EXPECT_EQ(local_bytes, g.bytes);
    EXPECT_EQ(remote_bytes, g.bytes);
    pieces_seen += g.pieces;
  }
  EXPECT_EQ(pieces_seen, static_cast<int>(pieces.size()));
  EXPECT_EQ(got_local, want_local);
  EXPECT_EQ(got_remote, want_remote);
}

TEST(RmaGroupsTest, ScatteredPiecesFillUpToTheIovLimits) {
  // Eight 100-byte pieces, nothing contiguous on either side.
  std::vector<RmaPiece> pieces;
  for (int i = 0; i < 8; ++i) {
    pieces.push_back({static_cast<uintptr_t>(10000 + 1000 * i), Desc(0),
                      static_cast<uint64_t>(90000 - 1000 * i), 7, 100});
  }
  const auto groups = GroupRmaPieces(pieces, {4, 4, 0});
  ASSERT_EQ(groups.size(), 2u);
  for (const RmaGroup& g : groups) {
    EXPECT_EQ(g.local.size(), 4u);
    EXPECT_EQ(g.remote.size(), 4u);
    EXPECT_EQ(g.pieces, 4);
    EXPECT_EQ(g.bytes, 400u);
  }
  EXPECT_EQ(groups[0].local[0].addr, 10000u);
  EXPECT_EQ(groups[1].local[0].addr, 14000u);
  ExpectSameBytes(pieces, groups);
}

TEST(RmaGroupsTest, ContiguousPiecesMergeIntoOneEntry) {
  // Contiguous locally and remotely: one entry each side, whatever the count.
  std::vector<RmaPiece> pieces;
  for (int i = 0; i < 10; ++i) {
    pieces.push_back({static_cast<uintptr_t>(5000 + 64 * i), Desc(1),
                      static_cast<uint64_t>(700 + 64 * i), 3, 64});
  }
  const auto groups = GroupRmaPieces(pieces, {1, 1, 0});
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].local.size(), 1u);
  EXPECT_EQ(groups[0].remote.size(), 1u);
  EXPECT_EQ(groups[0].bytes, 640u);
  EXPECT_EQ(groups[0].pieces, 10);
  ExpectSameBytes(pieces, groups);
}

TEST(RmaGroupsTest, OneSideContiguousUsesOneEntryThereOnly) {
  // Local contiguous (gathered from one buffer), remote scattered (one block
  // each): rma_iov_limit bounds the group, iov_limit 1 does not.
  std::vector<RmaPiece> pieces;
  for (int i = 0; i < 6; ++i) {
    pieces.push_back({static_cast<uintptr_t>(1 << 20) + 256 * i, Desc(2),
                      static_cast<uint64_t>(4096 * (6 - i)), 9, 256});
  }
  const auto groups = GroupRmaPieces(pieces, {1, 4, 0});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].local.size(), 1u);
  EXPECT_EQ(groups[0].remote.size(), 4u);
  EXPECT_EQ(groups[1].remote.size(), 2u);
  ExpectSameBytes(pieces, groups);
}

TEST(RmaGroupsTest, DifferentKeysOrDescriptorsDoNotMerge) {
  // Adjacent addresses but another registration: separate entries.
  const std::vector<RmaPiece> pieces = {
      {1000, Desc(0), 0, 1, 100},
      {1100, Desc(1), 100, 1, 100},  // other local MR
      {1200, Desc(1), 200, 2, 100},  // other remote key
  };
  const auto groups = GroupRmaPieces(pieces, {4, 4, 0});
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].local.size(), 2u);   // the last two share Desc(1)
  EXPECT_EQ(groups[0].remote.size(), 2u);  // the first two share key 1
  ExpectSameBytes(pieces, groups);
}

TEST(RmaGroupsTest, MaxBytesBoundsAGroupButNeverRefusesALonePiece) {
  const std::vector<RmaPiece> pieces = {
      {0, Desc(0), 0, 1, 600},
      {600, Desc(0), 600, 1, 600},     // contiguous, but 1200 > 1000
      {5000, Desc(0), 9000, 1, 3000},  // larger than max_bytes alone
      {9000, Desc(0), 20000, 1, 10},
  };
  const auto groups = GroupRmaPieces(pieces, {4, 4, 1000});
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].bytes, 600u);
  EXPECT_EQ(groups[1].bytes, 600u);
  EXPECT_EQ(groups[2].bytes, 3000u);
  EXPECT_EQ(groups[3].bytes, 10u);
  ExpectSameBytes(pieces, groups);
}

TEST(RmaGroupsTest, AppendRefusesWithoutChangingTheGroup) {
  RmaGroupLimits limits{2, 2, 0};
  RmaGroup g;
  ASSERT_TRUE(AppendToRmaGroup(limits, {0, Desc(0), 0, 1, 10}, &g));
  ASSERT_TRUE(AppendToRmaGroup(limits, {100, Desc(0), 100, 1, 10}, &g));
  const RmaGroup before = g;
  EXPECT_FALSE(AppendToRmaGroup(limits, {200, Desc(0), 200, 1, 10}, &g));
  EXPECT_EQ(g.local.size(), before.local.size());
  EXPECT_EQ(g.remote.size(), before.remote.size());
  EXPECT_EQ(g.bytes, before.bytes);
  EXPECT_EQ(g.pieces, before.pieces);
  // Contiguous with the last entries on both sides: still fits.
  EXPECT_TRUE(AppendToRmaGroup(limits, {110, Desc(0), 110, 1, 5}, &g));
  EXPECT_EQ(g.local.size(), 2u);
  EXPECT_EQ(g.bytes, 25u);
  // Zero limits act as one entry.
  RmaGroup z;
  EXPECT_TRUE(AppendToRmaGroup({0, 0, 0}, {0, Desc(0), 0, 1, 10}, &z));
  EXPECT_FALSE(AppendToRmaGroup({0, 0, 0}, {50, Desc(0), 50, 1, 10}, &z));
}

TEST(RmaGroupsTest, RandomLayoutsKeepOrderBytesAndLimits) {
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    const RmaGroupLimits limits{1 + rng() % 5, 1 + rng() % 5,
                                (rng() % 3 == 0) ? 0 : 64 + rng() % 2000};
    std::vector<RmaPiece> pieces;
    uintptr_t local = 4096;
    uint64_t remote = 1 << 20;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      // Sometimes contiguous, sometimes a gap, sometimes backwards.
      if (rng() % 3 == 0) local += 1 + rng() % 500;
      if (rng() % 3 == 0) remote = (rng() % 2) ? remote + 1 + rng() % 500 : remote / 2;
      const uint64_t len = 1 + rng() % 700;
      pieces.push_back(
          {local, Desc(static_cast<int>(rng() % 2)), remote, 1 + rng() % 2, len});
      local += len;
      remote += len;
    }
    const auto groups = GroupRmaPieces(pieces, limits);
    for (const RmaGroup& g : groups) {
      ASSERT_FALSE(g.empty());
      EXPECT_LE(g.local.size(), limits.iov_limit);
      EXPECT_LE(g.remote.size(), limits.rma_iov_limit);
      if (limits.max_bytes > 0 && g.pieces > 1) {
        EXPECT_LE(g.bytes, limits.max_bytes);
      }
    }
    ExpectSameBytes(pieces, groups);
  }
}

}  // namespace
}  // namespace tandem::kvtransfer
