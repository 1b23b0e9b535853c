// Backend::SampleTokens: the cuda_sim backend samples rows held in its own device
// memory and chooses the tokens (and logprobs, top-n) the CPU sampler chooses
// for the same rows; bad shapes and host pointers are refused with clear errors;
// the CPU backends do not offer it (their logits are sampled in place).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/sampling_args.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kVocab = 1000;
constexpr int kRows = 4;
constexpr int kTop = 5;

template <typename T>
DeviceBuffer Put(Device& dev, const std::vector<T>& v) {
  auto b = DeviceBuffer::Allocate(&dev, v.size() * sizeof(T));
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(dev.CopyToDevice(b->data(), v.data(), v.size() * sizeof(T)).ok());
  return std::move(b).value();
}

template <typename T>
std::vector<T> Get(Device& dev, const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(dev.CopyToHost(v.data(), b.data(), n * sizeof(T)).ok());
  return v;
}

TEST(SampleTokens, RowsInDeviceMemoryGiveTheCpuSamplersTokens) {
  auto be = CreateCudaSimBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  Backend& b = **be;
  ASSERT_TRUE(b.SupportsSampling());
  Device& dev = b.device();

  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> logits(kRows * kVocab);
  for (float& x : logits) x = d(rng);
  // Greedy; seeded at temperature 0.8 with top-k; seeded with top-p and
  // logprobs; greedy with logprobs and top-5 alternatives.
  std::vector<engine::SamplingParams> params(kRows);
  params[1].temperature = 0.8f;
  params[1].top_k = 50;
  params[1].seed = 1234;
  params[2].temperature = 1.0f;
  params[2].top_p = 0.9f;
  params[2].seed = 99;
  params[2].logprobs = true;
  params[3].logprobs = true;
  params[3].top_logprobs = kTop;
  std::vector<SamplingRowParams> rows(kRows);
  for (int r = 0; r < kRows; ++r) {
    const engine::SamplingParams& p = params[r];
    rows[r].temperature = p.temperature;
    rows[r].top_k = p.top_k;
    rows[r].top_p = p.top_p;
    rows[r].logprobs = p.logprobs ? 1 : 0;
    rows[r].top_logprobs = p.top_logprobs;
    rows[r].has_seed = p.seed.has_value() ? 1 : 0;
    rows[r].seed = p.seed.value_or(0);
    rows[r].position = 7 + r;
  }
  DeviceBuffer dl = Put(dev, logits), dp = Put(dev, rows);
  DeviceBuffer dt = Put(dev, std::vector<int32_t>(kRows, -7));
  DeviceBuffer ds = Put(dev, std::vector<int32_t>(kRows, -7));
  DeviceBuffer dlp = Put(dev, std::vector<float>(kRows, 0.0f));
  DeviceBuffer dti = Put(dev, std::vector<int32_t>(kRows * kTop, -7));
  DeviceBuffer dtl = Put(dev, std::vector<float>(kRows * kTop, 0.0f));
  SampleArgs a;
  a.rows = kRows;
  a.vocab = kVocab;
  a.logits = dl.as<float>();
  a.params = dp.as<SamplingRowParams>();
  a.token_ids = dt.as<int32_t>();
  a.row_status = ds.as<int32_t>();
  a.logprobs = dlp.as<float>();
  a.top_n_stride = kTop;
  a.top_ids = dti.as<int32_t>();
  a.top_logprobs = dtl.as<float>();
  ASSERT_TRUE(b.SampleTokens(a).ok());
  ASSERT_TRUE(b.Synchronize().ok());
  const auto tokens = Get<int32_t>(dev, dt, kRows);
  const auto status = Get<int32_t>(dev, ds, kRows);
  const auto lps = Get<float>(dev, dlp, kRows);
  const auto top_ids = Get<int32_t>(dev, dti, kRows * kTop);

  engine::Sampler cpu(kVocab);
  for (int r = 0; r < kRows; ++r) {
    engine::SampleRequest req;
    req.logits = absl::MakeConstSpan(logits).subspan(r * kVocab, kVocab);
    req.params = &params[r];
    req.position = 7 + r;
    absl::StatusOr<engine::SampleResult> want = cpu.Sample(req);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(status[r], kSampleOk) << "row " << r;
    EXPECT_EQ(tokens[r], want->token_id) << "row " << r;
    if (params[r].logprobs) {
      EXPECT_NEAR(lps[r], want->logprob, 1e-5) << "row " << r;
    }
    for (int j = 0; j < params[r].top_logprobs; ++j) {
      EXPECT_EQ(top_ids[r * kTop + j], want->top[j].token_id) << "row " << r;
    }
  }
}

TEST(SampleTokens, BadArgumentsAreRefusedClearly) {
  auto be = CreateCudaSimBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  Backend& b = **be;
  SampleArgs a;
  a.rows = 1;
  a.vocab = 0;
  EXPECT_EQ(b.SampleTokens(a).code(), absl::StatusCode::kInvalidArgument);
  a.vocab = kVocab;  // no buffers
  EXPECT_EQ(b.SampleTokens(a).code(), absl::StatusCode::kInvalidArgument);
  // Host memory where device memory is required.
  std::vector<float> logits(kVocab, 0.0f);
  std::vector<SamplingRowParams> params(1);
  std::vector<int32_t> out(1);
  a.logits = logits.data();
  a.params = params.data();
  a.token_ids = out.data();
  const absl::Status st = b.SampleTokens(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("not memory of device"), std::string::npos) << st;
  a.top_n_stride = kSamplingMaxTopLogprobs + 1;
  EXPECT_EQ(b.SampleTokens(a).code(), absl::StatusCode::kInvalidArgument);
  // No rows: nothing to do.
  SampleArgs none;
  none.vocab = kVocab;
  EXPECT_TRUE(b.SampleTokens(none).ok());
}

TEST(SampleTokens, HostBackendsLeaveSamplingToTheEngine) {
  for (const char* name : {"cpu", "cpu_reference"}) {
    auto be = CreateBackend(name);
    ASSERT_TRUE(be.ok()) << be.status();
    EXPECT_FALSE((*be)->SupportsSampling()) << name;
    SampleArgs a;
    const absl::Status st = (*be)->SampleTokens(a);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_NE(st.message().find(name), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace tandem::kernels::cuda
