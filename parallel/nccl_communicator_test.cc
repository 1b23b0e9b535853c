// NCCL communicator on real GPUs (tagged gpu + manual): exact collectives for a
// group of one rank and, when the machine has several GPUs, groups of 2/4/8
// ranks as threads (one device each); a rank that never joins ends Create with
// DEADLINE_EXCEEDED within the timeout (runs on one GPU); collectives on the
// caller's stream; Abort; a peer of an aborted rank fails within its timeout;
// stream-ordered collectives captured into a CUDA graph, and their bounded wait.
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "parallel/memory_store.h"

namespace tandem::parallel {
namespace {

float Value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 101) - 50 + rank);
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Device buffer holding `host`; copies back with Read().
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) cudaMalloc(&ptr_, bytes_);
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  template <typename T>
  T* as() {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  void Write(const std::vector<T>& host) {
    if (bytes_ > 0) cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice);
  }
  template <typename T>
  std::vector<T> Read() {
    std::vector<T> host(bytes_ / sizeof(T));
    if (bytes_ > 0) cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  size_t bytes_;
  void* ptr_ = nullptr;
};

// Every collective for one rank, against the sequential reference.
absl::Status CheckCollectives(NcclCommunicator& comm) {
  const int n = comm.size();
  const int rank = comm.rank();
  for (size_t len :
       {size_t{0}, size_t{1}, size_t{7}, size_t{65537}, size_t{1 << 20} + 3}) {
    std::vector<float> host(len);
    for (size_t i = 0; i < len; ++i) host[i] = Value(rank, i);
    DeviceBuffer buf(len * sizeof(float));
    buf.Write(host);
    if (auto s = comm.AllReduceSum(buf.as<float>(), len); !s.ok()) return s;
    std::vector<float> got = buf.Read<float>();
    for (size_t i = 0; i < len; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += Value(r, i);
      if (got[i] != want) {
        return absl::InternalError(
            absl::StrCat("all-reduce ", i, ": ", got[i], " want ", want));
      }
    }
    buf.Write(host);
    DeviceBuffer out(len * n * sizeof(float));
    if (auto s = comm.AllGather(buf.as<float>(), len, out.as<float>()); !s.ok()) {
      return s;
    }
    std::vector<float> all = out.Read<float>();
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < len; ++i) {
        if (all[r * len + i] != Value(r, i)) {
          return absl::InternalError(absl::StrCat("all-gather ", r, ",", i));
        }
      }
    }
    for (int root = 0; root < n; ++root) {
      std::vector<uint8_t> bytes(len);
      for (size_t i = 0; i < len; ++i) bytes[i] = static_cast<uint8_t>(i + rank);
      DeviceBuffer b(len);
      b.Write(bytes);
      if (auto s = comm.Broadcast(b.as<void>(), len, root); !s.ok()) return s;
      std::vector<uint8_t> back = b.Read<uint8_t>();
      for (size_t i = 0; i < len; ++i) {
        if (back[i] != static_cast<uint8_t>(i + root)) {
          return absl::InternalError(absl::StrCat("broadcast ", root, ",", i));
        }
      }
    }
    // BF16: small integers are exact.
    std::vector<uint16_t> h16(len);
    auto bf16 = [](int v) {
      float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      return static_cast<uint16_t>(bits >> 16);
    };
    for (size_t i = 0; i < len; ++i) h16[i] = bf16(static_cast<int>(i % 9) - 4);
    DeviceBuffer b16(len * 2);
    b16.Write(h16);
    if (auto s = comm.AllReduceSumBf16(b16.as<uint16_t>(), len); !s.ok()) {
      return s;
    }
    std::vector<uint16_t> g16 = b16.Read<uint16_t>();
    for (size_t i = 0; i < len; ++i) {
      if (g16[i] != bf16(n * (static_cast<int>(i % 9) - 4))) {
        return absl::InternalError(absl::StrCat("bf16 all-reduce ", i));
      }
    }
  }
  return comm.Barrier();
}

std::vector<absl::Status> RunNcclRanks(int n, absl::Duration timeout) {
  MemoryStore store;
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions o;
      o.rank = r;
      o.size = n;
      o.store = &store;
      o.device = r;
      o.timeout = timeout;
      auto comm = NcclCommunicator::Create(o);
      statuses[r] = comm.ok() ? CheckCollectives(**comm) : comm.status();
    });
  }
  for (auto& t : threads) t.join();
  return statuses;
}

TEST(NcclCommunicatorTest, SingleRankCollectivesAreExact) {
  ASSERT_GE(DeviceCount(), 1);
  for (const absl::Status& s : RunNcclRanks(1, absl::Seconds(60))) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(NcclCommunicatorTest, MultiGpuCollectivesAreExact) {
  const int devices = DeviceCount();
  ASSERT_GE(devices, 1);
  int groups = 0;
  for (int n : {2, 4, 8}) {
    if (n > devices) break;
    ++groups;
    for (const absl::Status& s : RunNcclRanks(n, absl::Seconds(60))) {
      EXPECT_TRUE(s.ok()) << n << " ranks: " << s;
    }
  }
  RecordProperty("multi_gpu_groups_run", groups);
}

TEST(NcclCommunicatorTest, RankThatNeverJoinsGivesDeadlineExceeded) {
  ASSERT_GE(DeviceCount(), 1);
  MemoryStore store;
  NcclOptions o;
  o.rank = 0;
  o.size = 2;  // rank 1 never starts
  o.store = &store;
  o.timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  absl::Status s = NcclCommunicator::Create(o).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(took, o.timeout + absl::Seconds(10));
}

TEST(NcclCommunicatorTest, MissingUniqueIdGivesDeadlineExceeded) {
  MemoryStore store;
  NcclOptions o;
  o.rank = 1;  // rank 0 never publishes the id
  o.size = 2;
  o.store = &store;
  o.timeout = absl::Milliseconds(300);
  absl::Status s = NcclCommunicator::Create(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

// The caller's stream (a backend's compute stream): the collectives run on it,
// work queued before them on it is ordered before them, and the communicator
// leaves it alive.
TEST(NcclCommunicatorTest, CollectivesRunOnTheCallersStream) {
  ASSERT_GE(DeviceCount(), 1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    MemoryStore store;
    NcclOptions o;
    o.store = &store;
    o.stream = stream;
    auto comm = NcclCommunicator::Create(o);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->stream(), static_cast<void*>(stream));
    EXPECT_TRUE((*comm)->takes_device_pointers());
    const std::vector<float> host(4096, 3.0f);
    DeviceBuffer buf(host.size() * sizeof(float));
    // Queued on the stream without a host wait: the all-reduce must see it.
    ASSERT_EQ(cudaMemcpyAsync(buf.as<float>(), host.data(), host.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_TRUE((*comm)->AllReduceSum(buf.as<float>(), host.size()).ok());
    EXPECT_EQ(buf.Read<float>(), host);  // one rank: the sum is the value
  }
  EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);  // still a valid stream
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Stream-ordered collectives captured into a CUDA graph on every rank (one
// thread per GPU, as the TP executor runs them; one rank where the machine has
// one GPU): the graph's all-reduce and all-gather run at each launch, the
// launch is waited for once (WaitForStream), and the results are exact.
TEST(NcclCommunicatorTest, EnqueuedCollectivesCaptureIntoAGraph) {
  const int devices = DeviceCount();
  ASSERT_GE(devices, 1);
  const int n = devices >= 2 ? 2 : 1;
  MemoryStore store;
  const size_t len = 4099;
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::Status& st = statuses[r];
      cudaSetDevice(r);
      cudaStream_t stream = nullptr;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      {
        NcclOptions o;
        o.rank = r;
        o.size = n;
        o.store = &store;
        o.device = r;
        o.stream = stream;
        o.timeout = absl::Seconds(30);
        auto comm = NcclCommunicator::Create(o);
        if (!comm.ok()) {
          st = comm.status();
          return;
        }
        EXPECT_TRUE((*comm)->stream_ordered());
        std::vector<float> host(len);
        for (size_t i = 0; i < len; ++i) host[i] = Value(r, i);
        DeviceBuffer src(len * sizeof(float)), buf(len * sizeof(float)),
            all(n * len * sizeof(float));
        src.Write(host);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) !=
            cudaSuccess) {
          st = absl::InternalError("begin capture");
          return;
        }
        cudaMemcpyAsync(buf.as<float>(), src.as<float>(), len * sizeof(float),
                        cudaMemcpyDeviceToDevice, stream);
        absl::Status a = (*comm)->EnqueueAllReduceSum(buf.as<float>(), len);
        absl::Status g =
            (*comm)->EnqueueAllGather(src.as<float>(), len, all.as<float>());
        const cudaError_t end = cudaStreamEndCapture(stream, &graph);
        if (!a.ok() || !g.ok() || end != cudaSuccess) {
          st = absl::InternalError(absl::StrCat("capture: ", a.ToString(), " ",
                                                g.ToString(), " ",
                                                cudaGetErrorString(end)));
          return;
        }
        if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
          st = absl::InternalError("instantiate");
          return;
        }
        for (int launch = 0; launch < 2 && st.ok(); ++launch) {
          cudaMemsetAsync(buf.as<float>(), 0, len * sizeof(float), stream);
          cudaGraphLaunch(exec, stream);
          st = (*comm)->WaitForStream();
          if (!st.ok()) break;
          const std::vector<float> sum = buf.Read<float>();
          const std::vector<float> gathered = all.Read<float>();
          for (size_t i = 0; i < len && st.ok(); ++i) {
            float want = 0;
            for (int q = 0; q < n; ++q) {
              want += Value(q, i);
              if (gathered[q * len + i] != Value(q, i)) {
                st = absl::InternalError(absl::StrCat("all-gather ", q, ",", i));
              }
            }
            if (sum[i] != want) {
              st = absl::InternalError(
                  absl::StrCat("all-reduce ", i, ": ", sum[i], " want ", want));
            }
          }
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  RecordProperty("graph_ranks", n);
}

// A stream-ordered all-reduce that a peer never joins: the enqueue returns at
// once, WaitForStream fails within the timeout (DEADLINE_EXCEEDED) and aborts
// the communicator rather than leaving the stream blocked for ever.
TEST(NcclCommunicatorTest, WaitForStreamBoundsAnEnqueuedCollective) {
  if (DeviceCount() < 2) {
    GTEST_SKIP() << "needs 2 GPUs, " << DeviceCount() << " visible";
  }
  MemoryStore store;
  const absl::Duration timeout = absl::Seconds(3);
  absl::Status enqueued, waited;
  absl::Duration took;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions o;
      o.rank = r;
      o.size = 2;
      o.store = &store;
      o.device = r;
      o.timeout = timeout;
      auto comm = NcclCommunicator::Create(o);
      if (!comm.ok() || r == 1) return;  // rank 1 never joins the all-reduce
      DeviceBuffer buf(256 * sizeof(float));
      const absl::Time t0 = absl::Now();
      enqueued = (*comm)->EnqueueAllReduceSum(buf.as<float>(), 256);
      waited = (*comm)->WaitForStream();
      took = absl::Now() - t0;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(enqueued.ok()) << enqueued;
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsUnavailable(waited))
      << waited;
  EXPECT_LT(took, timeout + absl::Seconds(10));
}

TEST(NcclCommunicatorTest, AbortMakesLaterCallsUnavailable) {
  ASSERT_GE(DeviceCount(), 1);
  MemoryStore store;
  NcclOptions o;
  o.store = &store;
  auto comm = NcclCommunicator::Create(o);
  ASSERT_TRUE(comm.ok()) << comm.status();
  (*comm)->Abort();
  DeviceBuffer buf(sizeof(float));
  absl::Status s = (*comm)->AllReduceSum(buf.as<float>(), 1);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("abort"), std::string::npos) << s;
}

// Two GPUs: rank 1 aborts instead of joining the all-reduce (a rank that
// stops); rank 0 fails within its timeout, never hangs.
TEST(NcclCommunicatorTest, PeerOfAnAbortedRankFailsWithinItsTimeout) {
  if (DeviceCount() < 2) {
    GTEST_SKIP() << "needs 2 GPUs, " << DeviceCount() << " visible";
  }
  MemoryStore store;
  const absl::Duration timeout = absl::Seconds(5);
  absl::Status s0, s1;
  absl::Duration took;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions o;
      o.rank = r;
      o.size = 2;
      o.store = &store;
      o.device = r;
      o.timeout = timeout;
      auto comm = NcclCommunicator::Create(o);
      absl::Status& mine = r == 0 ? s0 : s1;
      if (!comm.ok()) {
        mine = comm.status();
        return;
      }
      DeviceBuffer buf(1024 * sizeof(float));
      if (r == 1) {
        (*comm)->Abort();
        return;
      }
      const absl::Time t0 = absl::Now();
      mine = (*comm)->AllReduceSum(buf.as<float>(), 1024);
      took = absl::Now() - t0;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(s1.ok()) << s1;
  EXPECT_FALSE(s0.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s0) || absl::IsUnavailable(s0)) << s0;
  EXPECT_LT(took, timeout + absl::Seconds(10));
}

}  // namespace
}  // namespace tandem::parallel
