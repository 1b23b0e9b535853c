// GpuBackend's router and MoE methods (backend_moe.cc) on cuda_sim through the
// staging adapter: what the launcher tests (moe_test) do not reach, i.e. batches
// over kMoeChunkTokens (the method loops over chunks sharing one scratch) and the
// host-side argument checks.
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/moe.h"
#include "kernels/staging_backend.h"

namespace tandem::kernels::cuda {
namespace {

std::unique_ptr<Backend> SimBackend() {
  auto raw = CreateCudaSimBackend();
  EXPECT_TRUE(raw.ok()) << raw.status();
  if (!raw.ok()) return nullptr;
  StagingBackend::Options options;
  options.check_contents = false;  // ids reach the kernels
  return std::make_unique<StagingBackend>(std::move(raw).value(), options);
}

TEST(MoeBackendTest, BatchOverTheChunkSize) {
  auto be = SimBackend();
  ASSERT_NE(be, nullptr);
  auto ref = CreateReferenceBackend();
  std::mt19937 rng(31);
  const int64_t tokens = kMoeChunkTokens + 37, hidden = 64, inter = 32, top_k = 2,
                num_experts = 4;
  std::uniform_int_distribution<int> byte(0, 255), sc(120, 124), expert(-1, 3);
  std::vector<std::vector<uint8_t>> store;
  std::vector<Mxfp4Expert> experts(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows[3] = {inter, inter, hidden}, cols[3] = {hidden, hidden, inter};
    const uint8_t* p[6];
    for (int i = 0; i < 3; ++i) {
      store.emplace_back(rows[i] * cols[i] / 2);
      for (uint8_t& b : store.back()) b = static_cast<uint8_t>(byte(rng));
      p[2 * i] = store.back().data();
      store.emplace_back(rows[i] * cols[i] / 32);
      for (uint8_t& b : store.back()) b = static_cast<uint8_t>(sc(rng));
      p[2 * i + 1] = store.back().data();
    }
    experts[e] = {p[0], p[1], p[2], p[3], p[4], p[5]};
  }
  std::normal_distribution<float> nd(0.0f, 0.5f);
  std::vector<float> z(tokens * hidden), wts(tokens * top_k);
  for (float& v : z) v = nd(rng);
  for (float& v : wts) v = 0.5f + 0.1f * nd(rng);
  std::vector<int32_t> ids(tokens * top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    ids[t * 2] = expert(rng);
    ids[t * 2 + 1] = (ids[t * 2] + 1 + t % 3) % 4;
  }
  MoeArgs a;
  a.tokens = tokens;
  a.hidden = hidden;
  a.inter = inter;
  a.top_k = top_k;
  a.num_experts = num_experts;
  a.experts = experts.data();
  a.z = z.data();
  a.ld_z = hidden;
  a.ids = ids.data();
  a.weights = wts.data();
  a.ld_out = hidden;
  std::vector<float> want(tokens * hidden), got(tokens * hidden, 123.0f);
  a.out = want.data();
  ASSERT_TRUE(ref->MoeMxfp4(a).ok());
  a.out = got.data();
  ASSERT_TRUE(be->MoeMxfp4(a).ok());
  ASSERT_TRUE(be->Synchronize().ok());
  double max_want = 0, max_err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_want = std::max(max_want, std::fabs(static_cast<double>(want[i])));
    max_err = std::max(max_err, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LE(max_err, 1e-2 * max_want);
  EXPECT_GT(max_want, 0.0);
}

TEST(MoeBackendTest, RejectsBadArguments) {
  auto be = SimBackend();
  ASSERT_NE(be, nullptr);
  const int64_t hidden = 64, experts = 8;
  std::vector<float> x(2 * hidden, 0.5f), bias(experts, 0.0f), w(2 * (experts + 1));
  std::vector<uint16_t> gate(experts * hidden, 0x3f80);
  std::vector<int32_t> ids(2 * (experts + 1));  // room for the rejected top_k
  EXPECT_EQ(be->RouterTopK(x.data(), hidden, gate.data(), bias.data(), 2, hidden,
                           experts, experts + 1, true, 1.0f, ids.data(), w.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->RouterTopK(x.data(), hidden - 1, gate.data(), bias.data(), 2, hidden,
                           experts, 4, true, 1.0f, ids.data(), w.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(be->RouterTopK(x.data(), hidden, gate.data(), bias.data(), 2, hidden,
                             experts, 4, true, 1.0f, ids.data(), w.data())
                  .ok());
  // Equal gate rows and x: every s equal, ids 0..3 by the tie rule.
  ids.resize(8);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  MoeArgs a;
  a.tokens = 1;
  a.hidden = 48;  // not a multiple of 32
  a.inter = 32;
  EXPECT_EQ(be->MoeMxfp4(a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kernels::cuda
