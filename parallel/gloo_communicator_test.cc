// Gloo communicator over loopback with ranks as threads (RunRanks): every
// collective against a sequential reference, for 2/4/8 ranks and sizes from 0
// to several ring segments; failure paths (a rank that never joins, a rank that
// joins and stalls, a rank that leaves) end in a bounded time with the codes
// the interface promises.
#include "parallel/gloo_communicator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "parallel/file_store.h"
#include "parallel/memory_store.h"
#include "parallel/ranks.h"

namespace tandem::parallel {
namespace {

// Integers well inside float's exact range, so any summation order is exact.
float Value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 101) - 50 + rank);
}

absl::Status Mismatch(const char* what, int rank, size_t i, float got, float want) {
  return absl::InternalError(
      absl::StrCat(what, " rank ", rank, " index ", i, ": got ", got, " want ", want));
}

RunRanksOptions Fast() {
  RunRanksOptions o;
  o.timeout = absl::Seconds(20);
  return o;
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

const size_t kSizes[] = {0, 1, 2, 7, 64, 1001, 65537, 300007};

TEST_P(CollectivesTest, AllReduceSumIsExact) {
  const int n = GetParam();
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        if (comm.size() != n) return absl::InternalError("wrong size");
        for (size_t len : kSizes) {
          std::vector<float> data(len);
          for (size_t i = 0; i < len; ++i) data[i] = Value(comm.rank(), i);
          if (absl::Status st = comm.AllReduceSum(data.data(), len); !st.ok()) {
            return st;
          }
          for (size_t i = 0; i < len; ++i) {
            float want = 0;
            for (int r = 0; r < n; ++r) want += Value(r, i);
            if (data[i] != want) {
              return Mismatch("all-reduce", comm.rank(), i, data[i], want);
            }
          }
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST_P(CollectivesTest, AllReduceSumBf16IsExactOnSmallIntegers) {
  const int n = GetParam();
  // BF16 holds integers up to 256 exactly; partial sums stay below that.
  auto bf16 = [](int v) {
    float f = static_cast<float>(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  auto value = [](int rank, size_t i) {
    return static_cast<int>((i * 3 + rank) % 17) - 8;
  };
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        for (size_t len : {size_t{0}, size_t{1}, size_t{13}, size_t{40000}}) {
          std::vector<uint16_t> data(len);
          for (size_t i = 0; i < len; ++i) data[i] = bf16(value(comm.rank(), i));
          if (absl::Status st = comm.AllReduceSumBf16(data.data(), len); !st.ok()) {
            return st;
          }
          for (size_t i = 0; i < len; ++i) {
            int want = 0;
            for (int r = 0; r < n; ++r) want += value(r, i);
            if (data[i] != bf16(want)) {
              return Mismatch("bf16 all-reduce", comm.rank(), i, data[i], bf16(want));
            }
          }
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST_P(CollectivesTest, AllGatherIsRankOrdered) {
  const int n = GetParam();
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        for (size_t len : kSizes) {
          std::vector<float> in(len);
          for (size_t i = 0; i < len; ++i) in[i] = Value(comm.rank(), i);
          std::vector<float> out(len * n, -1.0f);
          if (absl::Status st = comm.AllGather(in.data(), len, out.data()); !st.ok()) {
            return st;
          }
          for (int r = 0; r < n; ++r) {
            for (size_t i = 0; i < len; ++i) {
              if (out[r * len + i] != Value(r, i)) {
                return Mismatch("all-gather", comm.rank(), r * len + i,
                                out[r * len + i], Value(r, i));
              }
            }
          }
          // The input is left as it was.
          for (size_t i = 0; i < len; ++i) {
            if (in[i] != Value(comm.rank(), i)) {
              return Mismatch("all-gather input", comm.rank(), i, in[i],
                              Value(comm.rank(), i));
            }
          }
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST_P(CollectivesTest, BroadcastFromEveryRoot) {
  const int n = GetParam();
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        for (int root = 0; root < n; ++root) {
          for (size_t bytes :
               {size_t{0}, size_t{1}, size_t{3}, size_t{4099}, size_t{1 << 20} + 5}) {
            std::vector<uint8_t> data(bytes);
            for (size_t i = 0; i < bytes; ++i) {
              data[i] = static_cast<uint8_t>(i * 31 + comm.rank() * 7 + 1);
            }
            if (absl::Status st = comm.Broadcast(data.data(), bytes, root); !st.ok()) {
              return st;
            }
            for (size_t i = 0; i < bytes; ++i) {
              const uint8_t want = static_cast<uint8_t>(i * 31 + root * 7 + 1);
              if (data[i] != want) {
                return Mismatch("broadcast", comm.rank(), i, data[i], want);
              }
            }
          }
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST_P(CollectivesTest, BarrierHoldsEveryRankUntilAllArrive) {
  const int n = GetParam();
  std::atomic<int> arrived{0};
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        for (int round = 1; round <= 20; ++round) {
          arrived.fetch_add(1);
          if (absl::Status st = comm.Barrier(); !st.ok()) return st;
          // Everyone has arrived for this round, and nobody can be two
          // rounds ahead, because the next barrier needs this rank.
          const int seen = arrived.load();
          if (seen < round * n || seen > (round + 1) * n) {
            return absl::InternalError(
                absl::StrCat("round ", round, " rank ", comm.rank(), " saw ", seen));
          }
          if (absl::Status st = comm.Barrier(); !st.ok()) return st;
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(arrived.load(), 20 * n);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesTest, ::testing::Values(2, 4, 8));

TEST(GlooCommunicatorTest, SingleRankIsIdentity) {
  absl::Status s = RunRanks(1, [](Communicator& comm) -> absl::Status {
    std::vector<float> v = {1, 2, 3};
    if (auto st = comm.AllReduceSum(v.data(), 3); !st.ok()) return st;
    std::vector<float> out(3);
    if (auto st = comm.AllGather(v.data(), 3, out.data()); !st.ok()) return st;
    if (auto st = comm.Barrier(); !st.ok()) return st;
    if (v != std::vector<float>{1, 2, 3} || out != v) {
      return absl::InternalError("size-1 collectives changed the data");
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(GlooCommunicatorTest, ThousandSmallAllReducesStayExact) {
  absl::Status s = RunRanks(
      4,
      [](Communicator& comm) -> absl::Status {
        for (int it = 0; it < 1000; ++it) {
          float v[3] = {static_cast<float>(comm.rank() + it), 1.0f,
                        static_cast<float>(comm.rank() * it)};
          if (auto st = comm.AllReduceSum(v, 3); !st.ok()) return st;
          const float want0 = 6.0f + 4.0f * it, want2 = 6.0f * it;
          if (v[0] != want0 || v[1] != 4.0f || v[2] != want2) {
            return absl::InternalError(
                absl::StrCat("iteration ", it, ": ", v[0], " ", v[1], " ", v[2]));
          }
        }
        return absl::OkStatus();
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST(GlooCommunicatorTest, BadRootIsRefusedAndLeavesTheGroupUsable) {
  absl::Status s = RunRanks(
      2,
      [](Communicator& comm) -> absl::Status {
        char b = 0;
        absl::Status bad = comm.Broadcast(&b, 1, 2);
        if (bad.code() != absl::StatusCode::kInvalidArgument) {
          return absl::InternalError(absl::StrCat("bad root gave ", bad.ToString()));
        }
        float v = 1;
        if (auto st = comm.AllReduceSum(&v, 1); !st.ok()) return st;
        return v == 2.0f ? absl::OkStatus() : absl::InternalError("sum");
      },
      Fast());
  EXPECT_TRUE(s.ok()) << s;
}

TEST(GlooCommunicatorTest, CreateRefusesBadOptions) {
  MemoryStore store;
  GlooOptions o;
  o.store = &store;
  o.rank = 2;
  o.size = 2;
  EXPECT_EQ(GlooCommunicator::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.rank = 0;
  o.store = nullptr;
  EXPECT_EQ(GlooCommunicator::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.store = &store;
  o.timeout = absl::InfiniteDuration();
  EXPECT_EQ(GlooCommunicator::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Ranks 0..n-2 of an n-rank group start; rank n-1 never does. Each must get
// DEADLINE_EXCEEDED from Create within about the timeout.
TEST(GlooCommunicatorTest, RankThatNeverJoinsGivesDeadlineExceeded) {
  const int n = 4;
  const absl::Duration timeout = absl::Milliseconds(800);
  MemoryStore store;
  std::vector<absl::Status> statuses(n - 1);
  std::vector<absl::Duration> took(n - 1);
  std::vector<std::thread> threads;
  for (int r = 0; r < n - 1; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.size = n;
      o.store = &store;
      o.timeout = timeout;
      const absl::Time start = absl::Now();
      statuses[r] = GlooCommunicator::Create(o).status();
      took[r] = absl::Now() - start;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n - 1; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded)
        << "rank " << r << ": " << statuses[r];
    EXPECT_LT(took[r], timeout + absl::Seconds(3)) << "rank " << r;
  }
}

// All ranks connect; the last one then stalls (alive, never calls the
// collective). The others' all-reduce must fail within about the timeout:
// DEADLINE_EXCEEDED where the wait ran out, UNAVAILABLE on ranks whose
// connections the timed-out rank closed. Afterwards the communicator refuses
// further calls.
TEST(GlooCommunicatorTest, StalledRankEndsCollectiveWithinTimeout) {
  const int n = 4;
  const absl::Duration timeout = absl::Milliseconds(800);
  absl::Notification others_done;
  std::atomic<int> finished{0};
  std::vector<absl::Status> first(n), second(n);
  std::vector<absl::Duration> took(n);
  RunRanksOptions options;
  options.timeout = timeout;
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        const int r = comm.rank();
        if (auto st = comm.Barrier(); !st.ok()) return st;  // all connected
        if (r == n - 1) {
          others_done.WaitForNotification();
          return absl::OkStatus();
        }
        std::vector<float> v(1000, 1.0f);
        const absl::Time start = absl::Now();
        first[r] = comm.AllReduceSum(v.data(), v.size());
        took[r] = absl::Now() - start;
        second[r] = comm.AllReduceSum(v.data(), v.size());
        if (finished.fetch_add(1) + 1 == n - 1) others_done.Notify();
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(s.ok()) << s;
  int deadline_count = 0;
  for (int r = 0; r < n - 1; ++r) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(first[r]) || absl::IsUnavailable(first[r]))
        << "rank " << r << ": " << first[r];
    deadline_count += absl::IsDeadlineExceeded(first[r]);
    EXPECT_LT(took[r], timeout + absl::Seconds(3)) << "rank " << r;
    EXPECT_TRUE(absl::IsUnavailable(second[r])) << "rank " << r << ": " << second[r];
  }
  EXPECT_GE(deadline_count, 1);
}

// A rank that leaves (its communicator destroyed) ends the others' collective
// with UNAVAILABLE long before their (long) timeout.
TEST(GlooCommunicatorTest, DepartedRankGivesUnavailableQuickly) {
  const int n = 3;
  RunRanksOptions options;
  options.timeout = absl::Seconds(30);
  std::vector<absl::Status> got(n);
  std::vector<absl::Duration> took(n);
  absl::Status s = RunRanks(
      n,
      [&](Communicator& comm) -> absl::Status {
        if (auto st = comm.Barrier(); !st.ok()) return st;
        if (comm.rank() == 1) return absl::OkStatus();  // leaves: destroyed
        std::vector<float> v(4096, 1.0f);
        const absl::Time start = absl::Now();
        got[comm.rank()] = comm.AllReduceSum(v.data(), v.size());
        took[comm.rank()] = absl::Now() - start;
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(s.ok()) << s;
  for (int r : {0, 2}) {
    EXPECT_TRUE(absl::IsUnavailable(got[r])) << "rank " << r << ": " << got[r];
    EXPECT_LT(took[r], absl::Seconds(10)) << "rank " << r;
  }
}

// Ranks that rendezvous through a directory (as separate processes on one
// host would), each with its own FileStore instance.
TEST(GlooCommunicatorTest, FileStoreRendezvous) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/gloo_file_store_",
                                       absl::ToUnixNanos(absl::Now()));
  const int n = 3;
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      FileStore store(dir);
      GlooOptions o;
      o.rank = r;
      o.size = n;
      o.store = &store;
      o.group = "file-group";
      o.timeout = absl::Seconds(20);
      auto comm = GlooCommunicator::Create(o);
      if (!comm.ok()) {
        statuses[r] = comm.status();
        return;
      }
      float v = static_cast<float>(r + 1);
      statuses[r] = (*comm)->AllReduceSum(&v, 1);
      if (statuses[r].ok() && v != 6.0f) {
        statuses[r] = absl::InternalError(absl::StrCat("sum ", v));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_TRUE(statuses[r].ok()) << statuses[r];
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tandem::parallel
