// The SIMT emulator keeps CUDA's execution model: indices, barriers, warp
// collectives, the PTX fragment layouts, and it shows the bugs a GPU shows (a
// missing barrier gives wrong results under some seeds; a deadlock or an illegal
// collective fails the launch).
#include "kernels/cuda/sim/simt.h"

#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/ptx.h"
#include "kernels/cuda/vendor.h"

namespace {

using tandem::gpu::Bf16ToF32;
using tandem::gpu::F32ToBf16;
using tandem::gpu::kFullMask;
using tandem::gpu::LaunchError;

class SeedGuard {
 public:
  SeedGuard() : saved_(cuda_sim::Seed()) {}
  ~SeedGuard() { cuda_sim::SetSeed(saved_); }

 private:
  uint64_t saved_;
};

// ---- Indices ----------------------------------------------------------------

__global__ void WriteIds(int* out, int n) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int per_block = blockDim.x * blockDim.y * blockDim.z;
  const int i = bid * per_block + tid;
  if (i < n) out[i] = i;
}

TEST(Simt, EveryThreadOfEveryBlockRunsOnceWithItsIndices) {
  const dim3 grid(3, 2, 2), block(5, 3, 2);
  const int n = 12 * 30;
  std::vector<int> out(n, -1);
  int* p = out.data();
  TANDEM_LAUNCH(WriteIds, grid, block, 0, nullptr, p, n);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int i = 0; i < n; ++i) ASSERT_EQ(out[i], i) << i;
}

// ---- Barriers ---------------------------------------------------------------------

template <bool kBarrier>
__global__ void Rotate(const int* in, int* out) {
  TANDEM_SHARED(int, tile, [64]);
  const int t = threadIdx.x;
  tile[t] = in[blockIdx.x * 64 + t] * 10;
  if (kBarrier) __syncthreads();
  out[blockIdx.x * 64 + t] = tile[(t + 1) % 64];
}

std::vector<int> RunRotate(bool barrier, uint64_t seed) {
  cuda_sim::SetSeed(seed);
  std::vector<int> in(128), out(128, 0);
  std::iota(in.begin(), in.end(), 1);
  const int* pi = in.data();
  int* po = out.data();
  if (barrier) {
    TANDEM_LAUNCH(Rotate<true>, dim3(2), dim3(64), 0, nullptr, pi, po);
  } else {
    TANDEM_LAUNCH(Rotate<false>, dim3(2), dim3(64), 0, nullptr, pi, po);
  }
  EXPECT_EQ(LaunchError(), nullptr);
  return out;
}

TEST(Simt, AMissingBarrierGivesWrongResultsUnderSomeSeeds) {
  SeedGuard guard;
  std::vector<int> want(128);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 64; ++t) want[b * 64 + t] = (b * 64 + (t + 1) % 64 + 1) * 10;
  int wrong_without = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    EXPECT_EQ(RunRotate(true, seed), want) << "with the barrier, seed " << seed;
    wrong_without += RunRotate(false, seed) != want;
  }
  EXPECT_GT(wrong_without, 0) << "the race never showed";
}

__global__ void BlockSum(const float* in, float* out, int n) {
  TANDEM_SHARED(float, partial, [256]);
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = partial[0];
}

TEST(Simt, TreeReductionWithBarriersIsRightUnderEverySeed) {
  SeedGuard guard;
  std::vector<float> in(1000);
  for (int i = 0; i < 1000; ++i) in[i] = static_cast<float>(i % 7);
  const float want = std::accumulate(in.begin(), in.end(), 0.0f);
  for (uint64_t seed = 0; seed < 5; ++seed) {
    cuda_sim::SetSeed(seed);
    float out = -1;
    const float* pi = in.data();
    float* po = &out;
    TANDEM_LAUNCH(BlockSum, dim3(1), dim3(256), 0, nullptr, pi, po, 1000);
    ASSERT_EQ(LaunchError(), nullptr);
    EXPECT_EQ(out, want) << "seed " << seed;
  }
}

// Static shared memory is poisoned per block, once: a block reads all-ones where
// it did not write, never what the block before it left (blocks run one after
// another on one OS thread, which keeps a `static thread_local`), and a thread
// that reaches the declaration after another thread of its block wrote does not
// wipe that write.
__global__ void ReadBeforeWrite(int* before, int* after) {
  TANDEM_SHARED(int, cell, [2]);
  if (threadIdx.x == 0) {
    before[blockIdx.x] = cell[0];
    cell[0] = 1000 + static_cast<int>(blockIdx.x);
  }
  __syncthreads();
  if (threadIdx.x == 1) after[blockIdx.x] = cell[0];
}

TEST(Simt, StaticSharedMemoryIsPoisonedOncePerBlock) {
  SeedGuard guard;
  for (uint64_t seed : {uint64_t{0}, uint64_t{3}}) {
    cuda_sim::SetSeed(seed);
    std::vector<int> before(3, 7), after(3, 7);
    int* pb = before.data();
    int* pa = after.data();
    TANDEM_LAUNCH(ReadBeforeWrite, dim3(3), dim3(32), 0, nullptr, pb, pa);
    ASSERT_EQ(LaunchError(), nullptr);
    for (int b = 0; b < 3; ++b) {
      EXPECT_EQ(before[b], -1) << "block " << b << " seed " << seed;
      EXPECT_EQ(after[b], 1000 + b) << "block " << b << " seed " << seed;
    }
  }
}

__global__ void TooMuchStaticShared(float* out) {
  TANDEM_SHARED(float, big, [13 * 1024]);  // 52 KiB
  big[threadIdx.x] = 1;
  out[0] = big[0];
}

TEST(Simt, StaticSharedMemoryOver48KiBFailsTheLaunch) {
  float out = 0;
  float* po = &out;
  TANDEM_LAUNCH(TooMuchStaticShared, dim3(1), dim3(32), 0, nullptr, po);
  const char* err = LaunchError();
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("48 KiB"), std::string::npos) << err;
}

// Without opting in, static and dynamic shared memory together may not pass
// 48 KiB (a GPU refuses the launch); opting in the dynamic part lifts that.
__global__ void StaticAndDynamicShared(float* out) {
  TANDEM_SHARED(float, fixed, [2048]);  // 8 KiB
  TANDEM_DYNAMIC_SMEM(float, dyn);
  fixed[threadIdx.x] = 1;
  dyn[threadIdx.x] = 2;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = fixed[0] + dyn[0];
}

TEST(Simt, StaticPlusDynamicSharedMemoryOver48KiBNeedsTheOptIn) {
  float out = 0;
  float* po = &out;
  const size_t dynamic = 44 << 10;
  TANDEM_LAUNCH(StaticAndDynamicShared, dim3(1), dim3(32), dynamic, nullptr, po);
  const char* err = LaunchError();
  ASSERT_NE(err, nullptr);
  EXPECT_NE(std::string(err).find("did not opt in"), std::string::npos) << err;
  ASSERT_EQ(tandem::gpu::AllowDynamicSmem(StaticAndDynamicShared, dynamic), nullptr);
  TANDEM_LAUNCH(StaticAndDynamicShared, dim3(1), dim3(32), dynamic, nullptr, po);
  ASSERT_EQ(LaunchError(), nullptr);
  EXPECT_EQ(out, 3);
}

__global__ void CountEven(int* out) {
  const int c = __syncthreads_count(threadIdx.x % 2 == 0);
  const int any = __syncthreads_or(threadIdx.x == 5);
  const int all = __syncthreads_and(threadIdx.x < 1000);
  if (threadIdx.x == 0) {
    out[0] = c;
    out[1] = any;
    out[2] = all;
  }
}

TEST(Simt, BarrierReductions) {
  int out[3] = {-1, -1, -1};
  int* p = out;
  TANDEM_LAUNCH(CountEven, dim3(1), dim3(96), 0, nullptr, p);
  ASSERT_EQ(LaunchError(), nullptr);
  EXPECT_EQ(out[0], 48);
  EXPECT_EQ(out[1], 1);
  EXPECT_EQ(out[2], 1);
}

__global__ void EarlyExit(int* out) {
  if (threadIdx.x >= 10) return;  // exited threads no longer count at barriers
  __syncthreads();
  atomicAdd(out, 1);
}

TEST(Simt, ExitedThreadsDoNotHoldBarriers) {
  int count = 0;
  int* p = &count;
  TANDEM_LAUNCH(EarlyExit, dim3(3), dim3(64), 0, nullptr, p);
  ASSERT_EQ(LaunchError(), nullptr);
  EXPECT_EQ(count, 30);
}

// ---- Warp collectives ---------------------------------------------------------------

__global__ void Shuffles(const int* in, int* out) {
  const int lane = threadIdx.x % 32;
  const int v = in[threadIdx.x];
  int* o = out + threadIdx.x * 6;
  o[0] = __shfl_sync(kFullMask, v, 7);
  o[1] = __shfl_xor_sync(kFullMask, v, 5);
  o[2] = __shfl_up_sync(kFullMask, v, 3);
  o[3] = __shfl_down_sync(kFullMask, v, 3, 16);
  o[4] = static_cast<int>(__ballot_sync(kFullMask, v % 3 == 0));
  o[5] = __shfl_sync(kFullMask, v, lane + 1, 8);
}

TEST(Simt, ShufflesAndBallotFollowCudaSemantics) {
  const int n = 64;
  std::vector<int> in(n), out(n * 6);
  for (int i = 0; i < n; ++i) in[i] = i * i + 1;
  const int* pi = in.data();
  int* po = out.data();
  TANDEM_LAUNCH(Shuffles, dim3(1), dim3(n), 0, nullptr, pi, po);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int t = 0; t < n; ++t) {
    const int w = t / 32 * 32, lane = t % 32;
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l) ballot |= (in[w + l] % 3 == 0 ? 1u : 0u) << l;
    EXPECT_EQ(out[t * 6 + 0], in[w + 7]);
    EXPECT_EQ(out[t * 6 + 1], in[w + (lane ^ 5)]);
    EXPECT_EQ(out[t * 6 + 2], lane < 3 ? in[t] : in[t - 3]);
    EXPECT_EQ(out[t * 6 + 3], lane % 16 + 3 >= 16 ? in[t] : in[t + 3]);
    EXPECT_EQ(static_cast<unsigned>(out[t * 6 + 4]), ballot);
    EXPECT_EQ(out[t * 6 + 5], in[w + lane / 8 * 8 + (lane + 1) % 8]);
  }
}

__global__ void WarpSums(const float* in, float* out) {
  const float s = tandem::gpu::WarpSum(in[threadIdx.x]);
  const float m = tandem::gpu::WarpMax(in[threadIdx.x]);
  if (threadIdx.x % 32 == 0) {
    out[threadIdx.x / 32 * 2] = s;
    out[threadIdx.x / 32 * 2 + 1] = m;
  }
}

TEST(Simt, WarpReductions) {
  std::vector<float> in(128), out(8);
  for (int i = 0; i < 128; ++i) in[i] = static_cast<float>((i * 37) % 101);
  const float* pi = in.data();
  float* po = out.data();
  TANDEM_LAUNCH(WarpSums, dim3(1), dim3(128), 0, nullptr, pi, po);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int w = 0; w < 4; ++w) {
    float s = 0, m = -1;
    for (int l = 0; l < 32; ++l) {
      s += in[w * 32 + l];
      m = std::max(m, in[w * 32 + l]);
    }
    EXPECT_EQ(out[w * 2], s);
    EXPECT_EQ(out[w * 2 + 1], m);
  }
}

__global__ void HalfWarpShuffle(int* out) {
  // Two disjoint groups in one warp, each with its own mask.
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<int>(threadIdx.x), 1);
}

TEST(Simt, DisjointMasksInOneWarp) {
  std::vector<int> out(32, -1);
  int* p = out.data();
  TANDEM_LAUNCH(HalfWarpShuffle, dim3(1), dim3(32), 0, nullptr, p);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int t = 0; t < 32; ++t) EXPECT_EQ(out[t], t ^ 1);
}

__global__ void Deadlock(int* out) {
  if (threadIdx.x % 32 < 16) {
    out[threadIdx.x] = __shfl_sync(kFullMask, 1, 0);  // lanes 16..31 never come
  } else {
    __syncthreads();
  }
}

__global__ void ReadOutsideMask(int* out) {
  if (threadIdx.x < 8) out[threadIdx.x] = __shfl_sync(0xffu, 1, 9);
}

__global__ void MaskNamesAbsentLanes(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(kFullMask, 1, 1);
}

TEST(Simt, IllegalCollectivesFailTheLaunch) {
  std::vector<int> out(64);
  int* p = out.data();
  TANDEM_LAUNCH(Deadlock, dim3(1), dim3(32), 0, nullptr, p);
  const char* e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("deadlock"), std::string::npos) << e;
  EXPECT_NE(std::string(e).find("Deadlock"), std::string::npos) << e;  // kernel name

  TANDEM_LAUNCH(ReadOutsideMask, dim3(1), dim3(32), 0, nullptr, p);
  e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("outside the mask"), std::string::npos) << e;

  TANDEM_LAUNCH(MaskNamesAbsentLanes, dim3(1), dim3(40), 0, nullptr, p);
  e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("do not exist"), std::string::npos) << e;
  EXPECT_EQ(LaunchError(), nullptr) << "the error is taken once";
}

__global__ void MisalignedCpAsync(const float* in, float* out) {
  TANDEM_SHARED(__align__(16) float, tile, [4 * 32 + 4]);
  // One float (4 bytes) past a 16-byte boundary: a GPU faults.
  tandem::gpu::CpAsync16(&tile[threadIdx.x * 4 + 1], &in[threadIdx.x * 4]);
  tandem::gpu::CpAsyncCommit();
  tandem::gpu::CpAsyncWait<0>();
  out[threadIdx.x] = tile[threadIdx.x * 4 + 1];
}

__global__ void MisalignedLdMatrix(uint32_t* out) {
  TANDEM_SHARED(__align__(16) uint16_t, tile, [4 * 64 + 8]);
  for (int i = threadIdx.x; i < 4 * 64 + 8; i += 32) tile[i] = static_cast<uint16_t>(i);
  __syncthreads();
  // Rows of 8 bf16 (16 bytes) starting 2 bytes into the tile.
  uint32_t r[4];
  tandem::gpu::LdMatrixX4(r, &tile[1 + 8 * threadIdx.x]);
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = r[i];
}

// cp.async and ldmatrix take 16-byte-aligned addresses; the emulator faults
// where a GPU would (a misaligned-address launch failure).
TEST(Simt, MisalignedAsyncCopiesAndMatrixLoadsFail) {
  std::vector<float> in(128, 1.0f), out(32);
  const float* src = in.data();
  float* dst = out.data();
  TANDEM_LAUNCH(MisalignedCpAsync, dim3(1), dim3(32), 0, nullptr, src, dst);
  const char* e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("cp.async: an address is not 16-byte aligned"),
            std::string::npos)
      << e;
  std::vector<uint32_t> words(128);
  uint32_t* w = words.data();
  TANDEM_LAUNCH(MisalignedLdMatrix, dim3(1), dim3(32), 0, nullptr, w);
  e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("ldmatrix: a row address is not 16-byte aligned"),
            std::string::npos)
      << e;
}

TEST(Simt, InvalidConfigurationsFail) {
  std::vector<int> out(4096);
  int* p = out.data();
  TANDEM_LAUNCH(WriteIds, dim3(1), dim3(2048), 0, nullptr, p, 4096);
  ASSERT_NE(LaunchError(), nullptr);
  TANDEM_LAUNCH(WriteIds, dim3(1), dim3(32), 64 << 10, nullptr, p, 4096);
  const char* e = LaunchError();
  ASSERT_NE(e, nullptr);
  EXPECT_NE(std::string(e).find("shared memory"), std::string::npos) << e;
  ASSERT_EQ(tandem::gpu::AllowDynamicSmem(WriteIds, 64 << 10), nullptr);
  TANDEM_LAUNCH(WriteIds, dim3(1), dim3(32), 64 << 10, nullptr, p, 4096);
  EXPECT_EQ(LaunchError(), nullptr);
}

// ---- Atomics, dynamic shared memory, seeds
// --------------------------------------------

__global__ void Tickets(int* counter, int* order) {
  const int ticket = atomicAdd(counter, 1);
  order[ticket] = blockIdx.x * blockDim.x + threadIdx.x;
}

std::vector<int> TicketOrder(uint64_t seed) {
  cuda_sim::SetSeed(seed);
  int counter = 0;
  std::vector<int> order(4 * 64, -1);
  int* c = &counter;
  int* o = order.data();
  TANDEM_LAUNCH(Tickets, dim3(4), dim3(64), 0, nullptr, c, o);
  EXPECT_EQ(LaunchError(), nullptr);
  EXPECT_EQ(counter, 256);
  return order;
}

TEST(Simt, SchedulesAreReproduciblePerSeedAndDifferAcrossSeeds) {
  SeedGuard guard;
  const std::vector<int> a = TicketOrder(3), b = TicketOrder(3), c = TicketOrder(4);
  std::vector<int> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 256; ++i) ASSERT_EQ(sorted[i], i);  // every thread once
  EXPECT_NE(a, TicketOrder(0));                           // seed 0: in order
  // Same seed, same launch number offset aside, the permutation differs per launch;
  // what must hold: different seeds give different orders.
  EXPECT_NE(a, c);
  (void)b;
}

__global__ void DynamicSmem(unsigned char* out, int n) {
  TANDEM_DYNAMIC_SMEM(unsigned char, buf);
  if (threadIdx.x == 0) {
    for (int i = 0; i < n; ++i) out[i] = buf[i];  // before any write: the poison
  }
  __syncthreads();
  buf[threadIdx.x] = static_cast<unsigned char>(threadIdx.x);
  __syncthreads();
  out[n + threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

TEST(Simt, DynamicSharedMemoryIsPerBlockAndPoisoned) {
  std::vector<unsigned char> out(64 + 64);
  unsigned char* p = out.data();
  TANDEM_LAUNCH(DynamicSmem, dim3(1), dim3(64), 64, nullptr, p, 64);
  ASSERT_EQ(LaunchError(), nullptr);
  // All-ones: NaN as fp32 or bf16, so a product with unwritten memory is NaN.
  for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], 0xFF);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[64 + t], (t + 1) % 64);
}

// ---- PTX: mma.sync m16n8k16, ldmatrix, cp.async ------------------------------------

// A [16][16] and B [16][8] (row-major, BF16 bits), D [16][8] fp32. Each lane loads
// its fragments exactly as the PTX ISA lays them out.
__global__ void MmaTile(const uint16_t* A, const uint16_t* B, const float* C,
                        float* D) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto a2 = [&](int r, int c) {
    return tandem::gpu::PackBf16x2(A[r * 16 + c], A[r * 16 + c + 1]);
  };
  auto b2 = [&](int k, int n) {
    return tandem::gpu::PackBf16x2(B[k * 8 + n], B[(k + 1) * 8 + n]);
  };
  const uint32_t a[4] = {a2(g, 2 * t), a2(g + 8, 2 * t), a2(g, 2 * t + 8),
                         a2(g + 8, 2 * t + 8)};
  const uint32_t b[2] = {b2(2 * t, g), b2(2 * t + 8, g)};
  float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t],
                C[(g + 8) * 8 + 2 * t + 1]};
  tandem::gpu::MmaBf16M16N8K16(d, a, b);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

TEST(Simt, MmaBf16M16N8K16MatchesTheMatrixProduct) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> A(256), B(128);
  std::vector<float> C(128), D(128, NAN);
  for (auto& x : A) x = F32ToBf16(nd(rng));
  for (auto& x : B) x = F32ToBf16(nd(rng));
  for (auto& x : C) x = nd(rng);
  const uint16_t* pa = A.data();
  const uint16_t* pb = B.data();
  const float* pc = C.data();
  float* pd = D.data();
  TANDEM_LAUNCH(MmaTile, dim3(1), dim3(32), 0, nullptr, pa, pb, pc, pd);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      double want = C[r * 8 + n];
      for (int k = 0; k < 16; ++k)
        want += double(Bf16ToF32(A[r * 16 + k])) * Bf16ToF32(B[k * 8 + n]);
      EXPECT_NEAR(D[r * 8 + n], want, 1e-4 * (1 + std::fabs(want))) << r << "," << n;
    }
  }
}

__global__ void LdMatrix(const uint16_t* in, uint32_t* out) {
  TANDEM_SHARED(uint16_t, tile, [4 * 64]);
  for (int i = threadIdx.x; i < 256; i += 32) tile[i] = in[i];
  __syncthreads();
  const int lane = threadIdx.x;
  uint32_t r[4];
  // lanes 8i..8i+7 address the rows of matrix i
  tandem::gpu::LdMatrixX4(r, &tile[(lane / 8) * 64 + (lane % 8) * 8]);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

TEST(Simt, LdMatrixX4GivesEachLaneItsFragment) {
  std::vector<uint16_t> in(256);
  for (int i = 0; i < 256; ++i) in[i] = static_cast<uint16_t>(i * 3 + 1);
  std::vector<uint32_t> out(128);
  const uint16_t* pi = in.data();
  uint32_t* po = out.data();
  TANDEM_LAUNCH(LdMatrix, dim3(1), dim3(32), 0, nullptr, pi, po);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int lane = 0; lane < 32; ++lane) {
    for (int m = 0; m < 4; ++m) {
      const int row = lane / 4, col = 2 * (lane % 4);
      const uint32_t want = tandem::gpu::PackBf16x2(in[m * 64 + row * 8 + col],
                                                    in[m * 64 + row * 8 + col + 1]);
      EXPECT_EQ(out[lane * 4 + m], want) << lane << " " << m;
    }
  }
}

__global__ void CpAsyncOrder(const float* in, float* before, float* after) {
  TANDEM_SHARED(__align__(16) float, tile, [4 * 32]);
  tile[threadIdx.x * 4] = -1;
  tandem::gpu::CpAsync16(&tile[threadIdx.x * 4], &in[threadIdx.x * 4]);
  tandem::gpu::CpAsyncCommit();
  before[threadIdx.x] = tile[threadIdx.x * 4];  // not waited yet: stale
  tandem::gpu::CpAsyncWait<0>();
  after[threadIdx.x] = tile[threadIdx.x * 4];
}

TEST(Simt, CpAsyncLandsAtTheWaitOrEarlierNeverLater) {
  SeedGuard guard;
  int early = 0, late = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    cuda_sim::SetSeed(seed);
    std::vector<float> in(128), before(32), after(32);
    for (int i = 0; i < 128; ++i) in[i] = static_cast<float>(i);
    const float* pi = in.data();
    float* pb = before.data();
    float* pa = after.data();
    TANDEM_LAUNCH(CpAsyncOrder, dim3(1), dim3(32), 0, nullptr, pi, pb, pa);
    ASSERT_EQ(LaunchError(), nullptr);
    for (int t = 0; t < 32; ++t) {
      EXPECT_EQ(after[t], static_cast<float>(t * 4));  // always there after the wait
      (before[t] == -1.0f ? late : early) += 1;
    }
  }
  EXPECT_GT(early, 0);
  EXPECT_GT(late, 0);
}

TEST(Simt, CpAsyncLandsOnlyWhenWaitedForAtSeedZero) {
  SeedGuard guard;
  cuda_sim::SetSeed(0);
  std::vector<float> in(128), before(32), after(32);
  for (int i = 0; i < 128; ++i) in[i] = static_cast<float>(i);
  const float* pi = in.data();
  float* pb = before.data();
  float* pa = after.data();
  TANDEM_LAUNCH(CpAsyncOrder, dim3(1), dim3(32), 0, nullptr, pi, pb, pa);
  ASSERT_EQ(LaunchError(), nullptr);
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(before[t], -1.0f);
    EXPECT_EQ(after[t], static_cast<float>(t * 4));
  }
}

TEST(Simt, StatsCountLaunchesAndSwitches) {
  const cuda_sim::Stats s0 = cuda_sim::GetStats();
  std::vector<float> in(256, 1.0f);
  float out = 0;
  const float* pi = in.data();
  float* po = &out;
  TANDEM_LAUNCH(BlockSum, dim3(1), dim3(256), 0, nullptr, pi, po, 256);
  ASSERT_EQ(LaunchError(), nullptr);
  const cuda_sim::Stats s1 = cuda_sim::GetStats();
  EXPECT_EQ(s1.launches, s0.launches + 1);
  EXPECT_EQ(s1.threads, s0.threads + 256);
  EXPECT_GE(s1.switches, s0.switches + 256 * 9);  // 9 barriers per thread
}

}  // namespace
