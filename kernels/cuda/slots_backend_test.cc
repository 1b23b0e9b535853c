// The slot-indexed KDA ops that CUDA-graph decode steps use
// (Backend::CausalConv1dSiluSlots, KdaRecurrentSlots; engine/runtime/model_runner.h
// "CUDA graphs") on "cuda_sim":
//   - equal to the CPU reference backend, whose Backend defaults make one
//     per-sequence call each;
//   - bit-identical to the GPU backend's own per-sequence calls (the batched launch
//     runs each sequence's arithmetic unchanged: graphs and eager steps agree);
//   - a padding sequence (slot -1) gets zero output rows and no state is touched;
//     slots not named keep their bytes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace tandem::kernels::cuda {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class SlotsBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    auto be = CreateCudaSimBackend();
    ASSERT_TRUE(be.ok()) << be.status();
    gpu_ = std::move(be).value();
    ref_ = CreateReferenceBackend();
  }
  template <typename T>
  T* Up(const std::vector<T>& host) {
    auto buf = DeviceBuffer::Allocate(&gpu_->device(), host.size() * sizeof(T));
    EXPECT_TRUE(buf.ok()) << buf.status();
    EXPECT_TRUE(gpu_->device()
                    .CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T))
                    .ok());
    T* p = static_cast<T*>(buf->data());
    buffers_.push_back(std::move(buf).value());
    return p;
  }
  template <typename T>
  std::vector<T> Down(const T* p, size_t n) {
    std::vector<T> host(n);
    EXPECT_TRUE(gpu_->Synchronize().ok());
    EXPECT_TRUE(gpu_->device().CopyToHost(host.data(), p, n * sizeof(T)).ok());
    return host;
  }

  std::unique_ptr<Backend> gpu_, ref_;
  std::vector<DeviceBuffer> buffers_;
};

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}

TEST_F(SlotsBackend, CausalConvOverSlotsEqualsPerSequenceCalls) {
  constexpr int64_t kSeqs = 4, T = 2, C = 40, K = 4, kPool = 5;
  constexpr int64_t kStride = (K - 1) * C + 7;  // slots need not be packed
  const std::vector<int32_t> slots = {3, -1, 0, 4};
  const std::vector<float> x = Random(kSeqs * T * C, 1), w = Random(C * K, 2);
  const std::vector<float> pool = Random(kPool * kStride, 3);

  // Reference (host device): the Backend default, one call per sequence.
  std::vector<float> ref_pool = pool, ref_y(kSeqs * T * C, -5.0f);
  ASSERT_TRUE(ref_->CausalConv1dSiluSlots(x.data(), C, w.data(), K, ref_pool.data(),
                                          kStride, slots.data(), kSeqs, ref_y.data(), C,
                                          T, C)
                  .ok());
  // GPU batched.
  float* d_pool = Up(pool);
  float* d_y = Up(std::vector<float>(kSeqs * T * C, -5.0f));
  const float* d_x = Up(x);
  const float* d_w = Up(w);
  ASSERT_TRUE(gpu_->CausalConv1dSiluSlots(d_x, C, d_w, K, d_pool, kStride, Up(slots),
                                          kSeqs, d_y, C, T, C)
                  .ok());
  const std::vector<float> y = Down(d_y, kSeqs * T * C);
  const std::vector<float> got_pool = Down(d_pool, kPool * kStride);
  EXPECT_LE(MaxDiff(y, ref_y), 1e-6);
  EXPECT_LE(MaxDiff(got_pool, ref_pool), 1e-6);
  // Padding: zero rows; slots 1 and 2 (not named) and slot 0's bytes past its
  // state are untouched.
  for (int64_t i = 0; i < T * C; ++i) {
    ASSERT_EQ(y[1 * T * C + i], 0.0f);
    ASSERT_EQ(ref_y[1 * T * C + i], 0.0f);
  }
  for (int64_t s : {1, 2}) {
    EXPECT_EQ(std::memcmp(got_pool.data() + s * kStride, pool.data() + s * kStride,
                          kStride * sizeof(float)),
              0)
        << "slot " << s;
  }
  EXPECT_EQ(std::memcmp(got_pool.data() + (K - 1) * C, pool.data() + (K - 1) * C,
                        7 * sizeof(float)),
            0);

  // The GPU's own per-sequence calls: bit for bit.
  float* d_pool1 = Up(pool);
  float* d_y1 = Up(std::vector<float>(kSeqs * T * C, 0.0f));
  for (int64_t s = 0; s < kSeqs; ++s) {
    if (slots[s] < 0) continue;
    ASSERT_TRUE(gpu_->CausalConv1dSilu(d_x + s * T * C, C, d_w, K,
                                       d_pool1 + slots[s] * kStride, d_y1 + s * T * C,
                                       C, T, C)
                    .ok());
  }
  EXPECT_EQ(Down(d_y1, kSeqs * T * C), y);
  EXPECT_EQ(Down(d_pool1, kPool * kStride), got_pool);
}

TEST_F(SlotsBackend, KdaRecurrenceOverSlotsEqualsPerSequenceCalls) {
  constexpr int64_t kSeqs = 3, T = 3, H = 2, D = 16, kPool = 3;
  constexpr int64_t kStride = H * D * D + 5;
  const std::vector<int32_t> slots = {2, -1, 0};
  const int64_t rows = kSeqs * T;
  const std::vector<float> q = Random(rows * H * D, 11, -0.3f, 0.3f);
  const std::vector<float> k = Random(rows * H * D, 12, -0.3f, 0.3f);
  const std::vector<float> v = Random(rows * H * D, 13);
  const std::vector<float> g = Random(rows * H * D, 14, -0.5f, 0.0f);
  const std::vector<float> beta = Random(rows * H, 15, 0.1f, 0.9f);
  const std::vector<float> pool = Random(kPool * kStride, 16, -0.2f, 0.2f);

  KdaArgs a;
  a.tokens = T;
  a.heads = H;
  a.head_dim_k = D;
  a.head_dim_v = D;
  a.ld_qk = H * D;
  a.ld_v = H * D;
  a.ld_out = H * D;
  // Reference: the Backend default over host memory.
  std::vector<float> ref_pool = pool, ref_out(rows * H * D, -5.0f);
  KdaArgs r = a;
  r.q = q.data();
  r.k = k.data();
  r.v = v.data();
  r.g = g.data();
  r.beta = beta.data();
  r.state = ref_pool.data();
  r.out = ref_out.data();
  ASSERT_TRUE(ref_->KdaRecurrentSlots(r, kSeqs, slots.data(), kStride).ok());
  // GPU batched.
  KdaArgs d = a;
  d.q = Up(q);
  d.k = Up(k);
  d.v = Up(v);
  d.g = Up(g);
  d.beta = Up(beta);
  d.state = Up(pool);
  d.out = Up(std::vector<float>(rows * H * D, -5.0f));
  ASSERT_TRUE(gpu_->KdaRecurrentSlots(d, kSeqs, Up(slots), kStride).ok());
  const std::vector<float> out = Down(d.out, rows * H * D);
  const std::vector<float> got_pool = Down(d.state, kPool * kStride);
  EXPECT_LE(MaxDiff(out, ref_out), 1e-5);
  EXPECT_LE(MaxDiff(got_pool, ref_pool), 1e-5);
  for (int64_t i = 0; i < T * H * D; ++i) {
    ASSERT_EQ(out[1 * T * H * D + i], 0.0f);
    ASSERT_EQ(ref_out[1 * T * H * D + i], 0.0f);
  }
  EXPECT_EQ(std::memcmp(got_pool.data() + 1 * kStride, pool.data() + 1 * kStride,
                        kStride * sizeof(float)),
            0);

  // The GPU's per-sequence calls: bit for bit.
  KdaArgs e = d;
  e.state = Up(pool);
  e.out = Up(std::vector<float>(rows * H * D, 0.0f));
  for (int64_t s = 0; s < kSeqs; ++s) {
    if (slots[s] < 0) continue;
    KdaArgs one = e;
    one.q = e.q + s * T * H * D;
    one.k = e.k + s * T * H * D;
    one.v = e.v + s * T * H * D;
    one.g = e.g + s * T * H * D;
    one.beta = e.beta + s * T * H;
    one.out = e.out + s * T * H * D;
    one.state = e.state + slots[s] * kStride;
    ASSERT_TRUE(gpu_->KdaRecurrent(one).ok());
  }
  EXPECT_EQ(Down(e.out, rows * H * D), out);
  EXPECT_EQ(Down(e.state, kPool * kStride), got_pool);
}

TEST_F(SlotsBackend, BadArgumentsAreErrors) {
  KdaArgs a;
  a.tokens = 1;
  a.heads = 1;
  a.head_dim_k = 4;
  a.head_dim_v = 4;
  EXPECT_FALSE(gpu_->KdaRecurrentSlots(a, 2, nullptr, 16).ok());
  EXPECT_FALSE(gpu_->KdaRecurrentSlots(a, -1, nullptr, 16).ok());
  EXPECT_FALSE(ref_->CausalConv1dSiluSlots(nullptr, 4, nullptr, 4, nullptr, 0, nullptr,
                                           2, nullptr, 4, 1, 4)
                   .ok());
  // Host memory where the slots must be device memory.
  const std::vector<int32_t> host_slots = {0};
  std::vector<float> host(64);
  EXPECT_FALSE(gpu_->CausalConv1dSiluSlots(Up(host), 4, Up(host), 4, Up(host), 12,
                                           host_slots.data(), 1, Up(host), 4, 1, 4)
                   .ok());
}

}  // namespace
}  // namespace tandem::kernels::cuda
