// GpuBackend's elementwise methods (backend_elementwise.cc) on "cuda_sim": the
// same InvalidArgument (code and message) as the CPU oracle for bad shapes, empty
// problems as no-ops, host pointers refused, and the kernels' index errors (token
// ids, cache slots) surfacing at the next Synchronize(). The numerics are the
// conformance suite's (kernels/conformance_test.cc, cuda_sim) and
// elementwise_test's.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace tandem::kernels::cuda {
namespace {

class ElementwiseBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    auto be = CreateCudaSimBackend();
    ASSERT_TRUE(be.ok()) << be.status();
    be_ = std::move(be).value();
    ref_ = CreateReferenceBackend();
  }

  // Device memory holding `host`'s bytes (freed with the fixture).
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    auto buf = DeviceBuffer::Allocate(&be_->device(), host.size() * sizeof(T));
    EXPECT_TRUE(buf.ok()) << buf.status();
    EXPECT_TRUE(be_->device()
                    .CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T))
                    .ok());
    T* p = static_cast<T*>(buf->data());
    buffers_.push_back(std::move(buf).value());
    return p;
  }
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    std::vector<T> host(n);
    EXPECT_TRUE(be_->device().CopyToHost(host.data(), p, n * sizeof(T)).ok());
    return host;
  }

  std::unique_ptr<Backend> be_, ref_;
  std::vector<DeviceBuffer> buffers_;
};

// Both backends reject with the same code and message.
void ExpectSameError(const absl::Status& want, const absl::Status& got,
                     const std::string& what) {
  EXPECT_FALSE(want.ok()) << what << ": the oracle accepted it";
  EXPECT_EQ(got.code(), want.code()) << what << ": " << got;
  EXPECT_EQ(got.message(), want.message()) << what;
}

TEST_F(ElementwiseBackend, BadShapesGiveTheCpuBackendsMessages) {
  // Shape checks run before anything touches memory: host pointers are fine here.
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  std::vector<int32_t> slots(4, 0);
  std::vector<uint16_t> cache(64, 0);
  float* x = a.data();
  float* y = c.data();
  const float* g = b.data();
#define SAME(call) ExpectSameError(ref_->call, be_->call, #call)
  SAME(RmsNorm(x, 4, g, y, 8, 2, 8, 1e-5f));
  SAME(RmsNorm(x, 8, g, y, 3, 2, 8, 1e-5f));
  SAME(RmsNorm(x, 8, g, y, 8, -1, 8, 1e-5f));
  SAME(L2NormHeads(x, 7, y, 8, 2, 2, 4, 1e-6f, 1.0f));
  SAME(L2NormHeads(x, 8, y, 8, 2, 2, -4, 1e-6f, 1.0f));
  SAME(SituGlu(x, 8, g, 5, y, 8, 3, 8, 4.0f, 25.0f));
  SAME(SituGlu(x, 8, g, 8, y, 2, 3, 8, 4.0f, 25.0f));
  SAME(MulSigmoid(x, 1, g, 8, y, 8, 2, 8));
  SAME(MulSigmoid(x, 8, g, 8, y, 8, 2, -8));
  SAME(CausalConv1dSilu(x, 8, g, 0, y, y, 8, 2, 8));
  SAME(CausalConv1dSilu(x, 8, g, 4, y, y, 7, 2, 8));
  SAME(CausalConv1dSilu(x, 4, g, 4, y, y, 8, 2, 8));
  SAME(KdaGates(x, 6, g, g, g, 2, -5.0f, 2, 2, 4, y, y));
  SAME(KdaGates(x, 8, g, g, g, 1, -5.0f, 2, 2, 4, y, y));
  SAME(KdaOutputGate(x, 8, g, g, 7, y, 8, 2, 2, 4, 1e-5f));
  SAME(KdaOutputGate(x, 8, g, g, 8, y, 8, -2, 2, 4, 1e-5f));
  SAME(PagedCacheWrite(x, 3, slots.data(), 2, 4, cache.data(), 4));
  SAME(PagedCacheWrite(x, 4, slots.data(), 2, -4, cache.data(), 4));
  SAME(AttnResMix(nullptr, -1, x, g, g, 1e-5f, 2, 8, y));
  SAME(AttnResMix(nullptr, 0, x, g, g, 1e-5f, -1, 8, y));
  SAME(AttnResMix(nullptr, 0, x, g, g, 1e-5f, 2, 0, y));
#undef SAME
}

TEST_F(ElementwiseBackend, EmptyProblemsAreNoOps) {
  EXPECT_TRUE(be_->RmsNorm(nullptr, 8, nullptr, nullptr, 8, 0, 8, 1e-5f).ok());
  EXPECT_TRUE(be_->RmsNorm(nullptr, 8, nullptr, nullptr, 8, 4, 0, 1e-5f).ok());
  EXPECT_TRUE(be_->L2NormHeads(nullptr, 8, nullptr, 8, 0, 2, 4, 1e-6f, 1.0f).ok());
  EXPECT_TRUE(be_->SituGlu(nullptr, 8, nullptr, 8, nullptr, 8, 0, 8, 4, 25).ok());
  EXPECT_TRUE(be_->MulSigmoid(nullptr, 8, nullptr, 8, nullptr, 8, 0, 8).ok());
  EXPECT_TRUE(be_->AddInPlace(nullptr, nullptr, 0).ok());
  EXPECT_TRUE(be_->EmbeddingGather(nullptr, 10, 8, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(
      be_->CausalConv1dSilu(nullptr, 8, nullptr, 4, nullptr, nullptr, 8, 0, 8).ok());
  EXPECT_TRUE(be_->KdaGates(nullptr, 8, nullptr, nullptr, nullptr, 2, -5.0f, 0, 2, 4,
                            nullptr, nullptr)
                  .ok());
  EXPECT_TRUE(
      be_->KdaOutputGate(nullptr, 8, nullptr, nullptr, 8, nullptr, 8, 0, 2, 4, 1e-5f)
          .ok());
  EXPECT_TRUE(be_->PagedCacheWrite(nullptr, 8, nullptr, 0, 8, nullptr, 4).ok());
  EXPECT_TRUE(
      be_->AttnResMix(nullptr, 2, nullptr, nullptr, nullptr, 1e-5f, 0, 8, nullptr)
          .ok());
  EXPECT_TRUE(be_->Synchronize().ok());
}

TEST_F(ElementwiseBackend, HostPointersAreRefused) {
  std::vector<float> x(16, 1.0f), w(16, 1.0f), y(16, 0.0f);
  const absl::Status st =
      be_->RmsNorm(x.data(), 16, w.data(), y.data(), 16, 1, 16, 1e-5f);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "rmsnorm x")) << st;
  // The same call on device memory runs.
  float* dx = Upload(x);
  float* dw = Upload(w);
  float* dy = Upload(y);
  ASSERT_TRUE(be_->RmsNorm(dx, 16, dw, dy, 16, 1, 16, 1e-5f).ok());
  ASSERT_TRUE(be_->Synchronize().ok());
  for (float v : Download(dy, 16)) EXPECT_NEAR(v, 1.0f, 1e-5f);
  // A range running past its allocation is refused too.
  EXPECT_EQ(be_->AddInPlace(dy, dx, 17).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ElementwiseBackend, IndexErrorsSurfaceAtSynchronize) {
  const int64_t vocab = 6, hidden = 8;
  std::vector<uint16_t> table(vocab * hidden, 0x3F80);  // 1.0
  uint16_t* dtable = Upload(table);
  int32_t* ids = Upload(std::vector<int32_t>{1, 6, 2});
  float* out = Upload(std::vector<float>(3 * hidden, 5.0f));
  // Enqueued: the op itself cannot see the ids (device memory).
  ASSERT_TRUE(be_->EmbeddingGather(dtable, vocab, hidden, ids, 3, out).ok());
  absl::Status st = be_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "token id out of range")) << st;
  EXPECT_TRUE(be_->Synchronize().ok()) << "the error word is cleared";
  auto got = Download(out, 3 * hidden);
  EXPECT_EQ(got[0], 1.0f);
  EXPECT_EQ(got[hidden], 0.0f);  // the bad row is zeroed
  EXPECT_EQ(got[2 * hidden], 1.0f);

  const int64_t width = 4, num_slots = 3;
  float* src = Upload(std::vector<float>(2 * width, 2.0f));
  int32_t* slots = Upload(std::vector<int32_t>{-1, 3});
  uint16_t* cache = Upload(std::vector<uint16_t>(num_slots * width, 0));
  ASSERT_TRUE(be_->PagedCacheWrite(src, width, slots, 2, width, cache, num_slots).ok());
  st = be_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "cache slot out of range")) << st;
  EXPECT_TRUE(be_->Synchronize().ok());
  // Good slots (and padding) leave the word clear.
  int32_t* good = Upload(std::vector<int32_t>{-1, 2});
  ASSERT_TRUE(be_->PagedCacheWrite(src, width, good, 2, width, cache, num_slots).ok());
  EXPECT_TRUE(be_->Synchronize().ok());
  auto c = Download(cache, num_slots * width);
  EXPECT_EQ(c[2 * width], 0x4000);  // 2.0
  EXPECT_EQ(c[0], 0);
}

}  // namespace
}  // namespace tandem::kernels::cuda
