#include "kernels/cuda/sim/sim_device.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

TEST(SimDevice, AllocationsAreAlignedTrackedAndRangeChecked) {
  auto dev = CreateSimDevice(1 << 20);
  EXPECT_EQ(dev->name(), "cuda_sim");
  EXPECT_TRUE(dev->host_addressable());
  auto a = DeviceBuffer::Allocate(dev.get(), 100);
  auto b = DeviceBuffer::Allocate(dev.get(), 1000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
  const char* pa = a->as<char>();
  EXPECT_TRUE(dev->Owns(pa, 100));
  EXPECT_TRUE(dev->Owns(pa + 99, 1));
  EXPECT_TRUE(dev->Owns(pa + 40, 60));
  EXPECT_FALSE(dev->Owns(pa + 40, 61));  // past the requested size
  EXPECT_FALSE(dev->Owns(pa + 100, 1));
  EXPECT_FALSE(dev->Owns(pa - 1, 1));
  std::vector<float> host(10);
  EXPECT_FALSE(dev->Owns(host.data(), sizeof(float)));
  EXPECT_FALSE(dev->Owns(nullptr, 0));
  // A fresh allocation is garbage (0xFF: fp32 NaN), as on a GPU.
  EXPECT_EQ(static_cast<unsigned char>(pa[7]), 0xffu);

  DeviceMemoryInfo info = dev->MemoryInfo();
  EXPECT_EQ(info.total_bytes, 1 << 20);
  EXPECT_EQ(info.allocated_bytes, 1100);
  EXPECT_EQ(info.free_bytes, (1 << 20) - 256 - 1024);
  void* freed = a->data();
  a->Reset();
  EXPECT_FALSE(dev->Owns(freed, 1));
  EXPECT_EQ(dev->MemoryInfo().allocated_bytes, 1000);
}

TEST(SimDevice, OutOfMemoryIsResourceExhaustedNamingSizes) {
  auto dev = CreateSimDevice(4096);
  auto a = DeviceBuffer::Allocate(dev.get(), 3000);
  ASSERT_TRUE(a.ok());
  auto b = DeviceBuffer::Allocate(dev.get(), 2000);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(b.status().message(), "2000 bytes")) << b.status();
  EXPECT_TRUE(absl::StrContains(b.status().message(), "1024 of 4096")) << b.status();
  a->Reset();
  EXPECT_TRUE(DeviceBuffer::Allocate(dev.get(), 2000).ok());
}

TEST(SimDevice, CapacityFromTheEnvironment) {
  ASSERT_EQ(setenv("TANDEM_SIM_DEVICE_BYTES", "12345", 1), 0);
  EXPECT_EQ(CreateSimDevice()->MemoryInfo().total_bytes, 12345);
  ASSERT_EQ(unsetenv("TANDEM_SIM_DEVICE_BYTES"), 0);
  EXPECT_EQ(CreateSimDevice()->MemoryInfo().total_bytes, kDefaultSimDeviceBytes);
}

TEST(SimDevice, CopiesCheckThatDevicePointersAreDeviceMemory) {
  auto dev = CreateSimDevice();
  auto buf = DeviceBuffer::Allocate(dev.get(), 16 * sizeof(int32_t));
  ASSERT_TRUE(buf.ok());
  std::vector<int32_t> in(16), out(16, 0), host(16);
  for (int i = 0; i < 16; ++i) in[i] = i * 3;
  ASSERT_TRUE(dev->CopyToDevice(buf->data(), in.data(), 64).ok());
  ASSERT_TRUE(dev->CopyOnDevice(buf->as<int32_t>() + 8, buf->data(), 32).ok());
  ASSERT_TRUE(dev->Memset(buf->data(), 0, 4).ok());
  ASSERT_TRUE(dev->CopyToHost(out.data(), buf->data(), 64).ok());
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 3);
  EXPECT_EQ(out[9], 3);
  // Host memory where device memory is expected, and a copy running off the end.
  EXPECT_EQ(dev->CopyToDevice(host.data(), in.data(), 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->CopyToHost(out.data(), host.data(), 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->CopyToHost(out.data(), buf->as<int32_t>() + 1, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->Memset(host.data(), 0, 4).code(), absl::StatusCode::kInvalidArgument);
}

// A batch of pieces of each kind lands where each piece says, on a stream of
// its own; a host pointer on the device side of any piece fails the batch.
TEST(SimDevice, BatchedCopiesLandEveryPieceAndCheckEachSide) {
  auto dev = CreateSimDevice();
  auto a = DeviceBuffer::Allocate(dev.get(), 4096);
  auto b = DeviceBuffer::Allocate(dev.get(), 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<uint8_t> in(4096), out(4096, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + 3);
  auto* da = a->as<uint8_t>();
  auto* db = b->as<uint8_t>();
  // Host -> device in three pieces, shuffled into a.
  ASSERT_TRUE(dev->CopyBatchAsync(CopyKind::kHostToDevice,
                                  {{da + 2048, in.data(), 2048},
                                   {da, in.data() + 2048, 1024},
                                   {da + 1024, in.data() + 3072, 1024}},
                                  stream->get())
                  .ok());
  // Device -> device: a's halves swapped into b; device -> host: all of b.
  ASSERT_TRUE(dev->CopyBatchAsync(CopyKind::kDeviceToDevice,
                                  {{db, da + 2048, 2048}, {db + 2048, da, 2048}},
                                  stream->get())
                  .ok());
  ASSERT_TRUE(
      dev->CopyBatchAsync(CopyKind::kDeviceToHost,
                          {{out.data() + 100, db + 100, 3996}, {out.data(), db, 100}},
                          stream->get())
          .ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  EXPECT_EQ(out, in);
  EXPECT_TRUE(dev->CopyBatchAsync(CopyKind::kDeviceToHost, {}, stream->get()).ok());
  std::vector<uint8_t> host(64);
  EXPECT_EQ(dev->CopyBatchAsync(CopyKind::kHostToDevice,
                                {{da, in.data(), 64}, {host.data(), in.data(), 64}})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      dev->CopyBatchAsync(CopyKind::kDeviceToDevice, {{db, host.data(), 64}}).code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(SimDevice, StreamsAreDistinctHandlesAndEventsComplete) {
  auto dev = CreateSimDevice();
  auto s1 = dev->CreateStream();
  auto s2 = dev->CreateStream();
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NE((*s1)->native(), nullptr);
  EXPECT_NE((*s1)->native(), (*s2)->native());
  EXPECT_NE((*s1)->native(), dev->compute_stream().native());
  auto ev = dev->CreateEvent();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE((*ev)->Record(**s1).ok());
  ASSERT_TRUE((*ev)->MakeWait(dev->compute_stream()).ok());
  auto done = (*ev)->Done();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_TRUE((*ev)->Synchronize().ok());
  EXPECT_TRUE(dev->Synchronize().ok());
}

// y[i] = 2 * x[i] + *bias as an emulated kernel launch on `stream` (the values the
// kernel reads are fetched when it runs; the pointers are fixed at launch).
void LaunchAxpb(const float* x, const float* bias, float* y, int n, void* stream) {
  cuda_sim::Launch("axpb", reinterpret_cast<const void*>(&LaunchAxpb), dim3(1),
                   dim3(32), 0, stream, [=]() {
                     for (int i = threadIdx.x; i < n; i += 32) y[i] = 2 * x[i] + *bias;
                   });
}

TEST(SimDevice, CapturedGraphReplaysLaunchesCopiesAndMemsetsWithFixedPointers) {
  auto dev = CreateSimDevice();
  EXPECT_TRUE(dev->supports_graphs());
  auto x = DeviceBuffer::Allocate(dev.get(), 8 * sizeof(float));
  auto bias = DeviceBuffer::Allocate(dev.get(), sizeof(float));
  auto y = DeviceBuffer::Allocate(dev.get(), 8 * sizeof(float));
  auto z = DeviceBuffer::Allocate(dev.get(), 8 * sizeof(float));
  ASSERT_TRUE(x.ok() && bias.ok() && y.ok() && z.ok());
  std::vector<float> in = {1, 2, 3, 4, 5, 6, 7, 8}, out(8);
  float b = 0.5f;
  ASSERT_TRUE(dev->CopyToDevice(x->data(), in.data(), 32).ok());
  ASSERT_TRUE(dev->CopyToDevice(bias->data(), &b, 4).ok());
  ASSERT_TRUE(dev->Memset(y->data(), 0, 32).ok());
  Stream& s = dev->compute_stream();
  ASSERT_TRUE(s.BeginCapture().ok());
  EXPECT_TRUE(s.capturing());
  EXPECT_EQ(s.BeginCapture().code(), absl::StatusCode::kFailedPrecondition);
  const uint64_t launches = cuda_sim::GetStats().launches;
  LaunchAxpb(x->as<float>(), bias->as<float>(), y->as<float>(), 8, s.native());
  ASSERT_EQ(cuda_sim::TakeLaunchError(), nullptr);
  ASSERT_TRUE(dev->CopyOnDevice(z->data(), y->data(), 32).ok());
  ASSERT_TRUE(dev->Memset(y->data(), 0, 16).ok());  // y[0..3] = 0 after the copy
  auto graph = s.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_FALSE(s.capturing());
  EXPECT_EQ((*graph)->num_nodes(), 3);
  // Nothing ran during the capture.
  EXPECT_EQ(cuda_sim::GetStats().launches, launches);
  ASSERT_TRUE(dev->CopyToHost(out.data(), y->data(), 32).ok());
  EXPECT_EQ(out[5], 0.0f);

  for (float bv : {0.5f, -1.0f}) {  // new inputs in the same buffers, replayed
    ASSERT_TRUE(dev->CopyToDevice(bias->data(), &bv, 4).ok());
    ASSERT_TRUE((*graph)->Launch(s).ok());
    ASSERT_TRUE(dev->CopyToHost(out.data(), z->data(), 32).ok());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], 2 * in[i] + bv) << i;
    ASSERT_TRUE(dev->CopyToHost(out.data(), y->data(), 32).ok());
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[3], 0.0f);
    EXPECT_EQ(out[4], 2 * in[4] + bv);
  }
  EXPECT_EQ(cuda_sim::GetStats().launches, launches + 2);
}

TEST(SimDevice, CaptureRulesHostCopiesSynchronizeAndAllocationFailTheCapture) {
  auto dev = CreateSimDevice();
  auto buf = DeviceBuffer::Allocate(dev.get(), 64);
  ASSERT_TRUE(buf.ok());
  std::vector<char> host(64);
  Stream& s = dev->compute_stream();
  struct Case {
    const char* name;
    std::function<absl::Status()> op;
  };
  const std::vector<Case> cases = {
      {"CopyToHost", [&] { return dev->CopyToHost(host.data(), buf->data(), 64); }},
      {"CopyToDevice", [&] { return dev->CopyToDevice(buf->data(), host.data(), 64); }},
      {"Synchronize", [&] { return dev->Synchronize(); }},
      {"Allocate", [&] { return DeviceBuffer::Allocate(dev.get(), 64).status(); }},
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(s.BeginCapture().ok()) << c.name;
    ASSERT_TRUE(dev->Memset(buf->data(), 1, 64).ok());  // capturable
    absl::Status st = c.op();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.name << ": " << st;
    EXPECT_TRUE(absl::StrContains(st.message(), c.name)) << st;
    auto graph = s.EndCapture();
    EXPECT_FALSE(graph.ok()) << c.name;
    EXPECT_TRUE(absl::StrContains(graph.status().message(), c.name)) << graph.status();
    EXPECT_FALSE(s.capturing());
  }
  // A stream that does not capture is unaffected, and EndCapture without a
  // capture is an error.
  EXPECT_TRUE(dev->CopyToHost(host.data(), buf->data(), 64).ok());
  EXPECT_FALSE(s.EndCapture().ok());
  // Another stream's capture does not restrict the compute stream's copies.
  auto other = dev->CreateStream();
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->BeginCapture().ok());
  EXPECT_TRUE(dev->CopyToHost(host.data(), buf->data(), 64).ok());
  EXPECT_TRUE((*other)->EndCapture().ok());
}

// Another thread's device calls while one thread captures the compute stream
// (the decode service hashing a landed hand-off while the engine captures a
// decode graph): they wait for the capture to end, then succeed, and the
// capture is not broken by them: an allocation, a free, a synchronisation and
// copies on the compute stream, none of which is recorded into the graph.
TEST(SimDevice, OtherThreadsWaitOutACaptureOfTheComputeStream) {
  auto dev = CreateSimDevice();
  auto buf = DeviceBuffer::Allocate(dev.get(), 64);
  auto old = DeviceBuffer::Allocate(dev.get(), 64);
  ASSERT_TRUE(buf.ok() && old.ok());
  Stream& s = dev->compute_stream();
  ASSERT_TRUE(s.BeginCapture().ok());
  ASSERT_TRUE(dev->Memset(buf->data(), 7, 64).ok());  // captured
  std::atomic<bool> capture_ended{false};
  std::atomic<int> ran_during_capture{0};
  absl::Status other_status;
  std::thread other([&] {
    auto check = [&](absl::Status st) {
      if (!capture_ended.load()) ++ran_during_capture;
      if (other_status.ok()) other_status = st;
    };
    auto grown = DeviceBuffer::Allocate(dev.get(), 4096);
    check(grown.status());
    old->Reset();  // a free
    check(absl::OkStatus());
    check(dev->Synchronize());
    std::vector<char> host(64, 3);
    if (grown.ok()) {
      check(dev->CopyToDevice(grown->data(), host.data(), 64));
      check(dev->Memset(grown->data(), 5, 64));
      check(dev->CopyToHost(host.data(), grown->data(), 64));
      EXPECT_EQ(host[0], 5);
    }
  });
  absl::SleepFor(absl::Milliseconds(200));  // the other thread is waiting by now
  capture_ended.store(true);
  auto graph = s.EndCapture();
  other.join();
  EXPECT_TRUE(other_status.ok()) << other_status;
  EXPECT_EQ(ran_during_capture.load(), 0);
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ((*graph)->num_nodes(), 1);  // the memset only
  // The capturing thread's own calls are still refused (CaptureRules... above).
}

// Host functions run in stream order: now on a stream that does not capture,
// as a node of the graph (at each launch, between the device work around it)
// on one that does; the host device runs them now.
TEST(SimDevice, HostFunctionsRunInStreamOrderAndReplayInGraphs) {
  auto dev = CreateSimDevice();
  auto buf = DeviceBuffer::Allocate(dev.get(), 4 * sizeof(float));
  ASSERT_TRUE(buf.ok());
  float* p = buf->as<float>();
  Stream& s = dev->compute_stream();
  std::vector<float> seen;
  ASSERT_TRUE(dev->Memset(p, 0, 16).ok());
  ASSERT_TRUE(s.EnqueueHostFunction([&] { seen.push_back(p[0]); }).ok());
  EXPECT_EQ(seen, std::vector<float>{0.0f});  // ran now
  ASSERT_TRUE(s.BeginCapture().ok());
  const float one = 1.0f;
  ASSERT_TRUE(dev->Memset(p, 0, 16).ok());
  ASSERT_TRUE(s.EnqueueHostFunction([&] {
                 seen.push_back(p[0]);
                 p[0] += one;  // a host collective writes device memory in place
               }).ok());
  ASSERT_TRUE(dev->CopyOnDevice(p + 1, p, sizeof(float)).ok());
  auto graph = s.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ((*graph)->num_nodes(), 3);
  EXPECT_EQ(seen.size(), 1u);  // recorded, not run
  for (int launch = 0; launch < 2; ++launch) {
    ASSERT_TRUE((*graph)->Launch(s).ok());
    EXPECT_EQ(seen.back(), 0.0f);  // after the memset
    EXPECT_EQ(p[1], 1.0f);         // before the copy
  }
  EXPECT_EQ(seen.size(), 3u);
  int ran = 0;
  auto host = CreateHostDevice();
  ASSERT_TRUE(host->compute_stream().EnqueueHostFunction([&] { ++ran; }).ok());
  EXPECT_EQ(ran, 1);
}

// CopyOnDevice2D: rows of `width` bytes between pitched layouts, captured like
// any copy; pitches below the width are refused.
TEST(SimDevice, StridedCopiesMoveRowsBetweenPitchesAndCapture) {
  for (bool host_device : {false, true}) {
    auto dev = host_device ? CreateHostDevice() : CreateSimDevice();
    auto src = DeviceBuffer::Allocate(dev.get(), 3 * 5 * sizeof(float));
    auto dst = DeviceBuffer::Allocate(dev.get(), 3 * 8 * sizeof(float));
    ASSERT_TRUE(src.ok() && dst.ok());
    std::vector<float> in(15), out(24, -1.0f);
    for (int i = 0; i < 15; ++i) in[i] = static_cast<float>(i);
    ASSERT_TRUE(dev->CopyToDevice(src->data(), in.data(), 60).ok());
    ASSERT_TRUE(dev->CopyToDevice(dst->data(), out.data(), 96).ok());
    // Columns 1..3 of the [3, 5] source into columns 2..4 of the [3, 8] one.
    ASSERT_TRUE(dev->CopyOnDevice2D(dst->as<float>() + 2, 8 * sizeof(float),
                                    src->as<float>() + 1, 5 * sizeof(float),
                                    3 * sizeof(float), 3)
                    .ok());
    ASSERT_TRUE(dev->CopyToHost(out.data(), dst->data(), 96).ok());
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 8; ++c) {
        const float want = c >= 2 && c < 5 ? in[r * 5 + c - 1] : -1.0f;
        EXPECT_EQ(out[r * 8 + c], want) << r << "," << c;
      }
    }
    EXPECT_EQ(dev->CopyOnDevice2D(dst->data(), 4, src->data(), 20, 8, 2).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(dev->CopyOnDevice2D(dst->data(), 4, src->data(), 4, 0, 2).ok());
  }
}

TEST(SimDevice, TheHostDeviceHasNoGraphs) {
  auto host = CreateHostDevice();
  EXPECT_FALSE(host->supports_graphs());
  EXPECT_EQ(host->compute_stream().BeginCapture().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace tandem::kernels::cuda
