// DeviceSampler on the emulated GPU (cuda_sim; and on "cuda" where a GPU is
// visible, the GPU bundle's instance) against engine::Sampler, the
// host sampler whose results it must reproduce: for the same logits, parameters,
// penalty history, suppressed tokens and seed, the same token, logprob and
// alternatives (bit-identical under the emulator, whose exp and log are the
// host's: kernels/cuda/sampling.h, "Exactness"), and the same per-row errors
// with the same messages, structured-output masks included. Also: the inputs it
// refuses, and a backend that does not sample on its device.
#include "engine/runtime/device_sampler.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/sampler.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kernels/device.h"

namespace tandem::engine {
namespace {

constexpr int kVocab = 777;  // not a multiple of the kernels' 256-token chunks

// The device backends this binary can open: cuda_sim (not in a --config=cuda
// build), and cuda where a GPU is visible (the GPU bundle runs that instance).
std::vector<std::string> DeviceBackends() {
  std::vector<std::string> names;
  for (const char* n : {"cuda_sim", "cuda"}) {
    if (kernels::CreateBackend(n).ok()) names.push_back(n);
  }
  return names;
}

class DeviceSamplerTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<kernels::Backend> Open() {
    auto b = kernels::CreateBackend(GetParam());
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : nullptr;
  }
  // Under the emulator exp and log are the host's: bit-identical logprobs. On a
  // GPU expf/logf may differ from glibc's in the last bit (sampling.h).
  void ExpectLogprob(float got, float want, const std::string& what) {
    if (GetParam() == "cuda_sim") {
      EXPECT_EQ(got, want) << what;
    } else {
      EXPECT_NEAR(got, want, 1e-5) << what;
    }
  }
};

// Logits in device memory, and a copy on the host for the reference.
struct DeviceLogits {
  kernels::DeviceBuffer buf;
  std::vector<float> host;
};

DeviceLogits Upload(kernels::Backend& be, const std::vector<float>& host) {
  DeviceLogits d;
  d.host = host;
  auto b = kernels::DeviceBuffer::Allocate(&be.device(), host.size() * sizeof(float));
  EXPECT_TRUE(b.ok()) << b.status();
  d.buf = std::move(b).value();
  EXPECT_TRUE(be.device()
                  .CopyToDevice(d.buf.data(), host.data(), host.size() * sizeof(float))
                  .ok());
  return d;
}

std::vector<float> RandomLogits(int rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.5f);
  std::vector<float> v(static_cast<size_t>(rows) * kVocab);
  for (float& x : v) x = d(rng);
  return v;
}

TEST_P(DeviceSamplerTest, RowsGiveTheHostSamplersTokensLogprobsAndAlternatives) {
  auto be = Open();
  ASSERT_NE(be, nullptr);
  ASSERT_TRUE(be->SupportsSampling());

  // One row per feature, and rows that combine them.
  std::vector<SamplingParams> params(8);
  params[1].temperature = 0.7f;  // seeded, top-k
  params[1].top_k = 40;
  params[1].seed = 11;
  params[2].temperature = 1.0f;  // seeded, top-p and min-p, logprobs
  params[2].top_p = 0.85f;
  params[2].min_p = 0.02f;
  params[2].seed = 12;
  params[2].logprobs = true;
  params[3].repetition_penalty = 1.4f;  // greedy with every penalty
  params[3].presence_penalty = 0.6f;
  params[3].frequency_penalty = 0.35f;
  params[4].temperature = 0.9f;  // seeded, penalties, logprobs with 5 alternatives
  params[4].seed = 14;
  params[4].repetition_penalty = 0.8f;
  params[4].frequency_penalty = -0.4f;
  params[4].logprobs = true;
  params[4].top_logprobs = 5;
  params[5].logprobs = true;  // greedy with 20 alternatives
  params[5].top_logprobs = 20;
  params[6].temperature = 1.3f;  // seeded, no truncation
  params[6].seed = 16;
  params[7].temperature = 0.5f;  // seeded, everything at once
  params[7].top_k = 100;
  params[7].top_p = 0.95f;
  params[7].seed = 17;
  params[7].presence_penalty = 1.0f;
  params[7].logprobs = true;
  params[7].top_logprobs = 3;

  // Histories: prompt tokens, output tokens (some repeated, some also in the
  // prompt), and ids outside the vocabulary (ignored by both samplers).
  std::vector<PenaltyState> hist(params.size());
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, kVocab - 1);
  for (size_t r = 0; r < hist.size(); ++r) {
    std::vector<int32_t> prompt;
    for (int i = 0; i < 60; ++i) prompt.push_back(tok(rng));
    prompt.push_back(kVocab + 5);
    prompt.push_back(-3);
    hist[r].AddPromptTokens(prompt);
    for (int i = 0; i < 25; ++i)
      hist[r].AddOutputToken(i % 3 == 0 ? prompt[i] : tok(rng));
    hist[r].AddOutputToken(kVocab);
  }
  // Suppressed: a few ids (one repeated, one outside the vocabulary).
  const std::vector<int32_t> suppressed = {7, 7, 400, kVocab + 1, -1};

  const int rows = static_cast<int>(params.size());
  DeviceLogits logits = Upload(*be, RandomLogits(rows, 9));
  // Structured-output masks on rows 1 (sampled) and 5 (greedy, alternatives):
  // every third word allowed, and in the others a few scattered bits.
  std::vector<std::vector<uint32_t>> masks(rows);
  for (int r : {1, 5}) {
    masks[r].assign((kVocab + 31) / 32, 0u);
    for (size_t w = 0; w < masks[r].size(); ++w) {
      masks[r][w] = w % 3 == 0 ? ~0u : (0x01010101u << (w % 8));
    }
  }
  std::vector<DeviceSampler::Row> in(rows);
  for (int r = 0; r < rows; ++r) {
    in[r].params = &params[r];
    in[r].history = &hist[r];
    in[r].suppressed_tokens =
        r % 2 == 0 ? absl::MakeConstSpan(suppressed) : absl::Span<const int32_t>();
    in[r].allowed_bitmask = masks[r];
    in[r].position = 3 * r + 1;
  }
  DeviceSampler ds(be.get(), kVocab);
  ASSERT_TRUE(ds.Prepare(in).ok());
  std::vector<absl::StatusOr<SampleResult>> got;
  absl::Status st = ds.Run(logits.buf.as<float>(), &got);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(got.size(), static_cast<size_t>(rows));
  EXPECT_GT(ds.device_bytes(), 0);

  Sampler cpu(kVocab);
  for (int r = 0; r < rows; ++r) {
    SampleRequest sr;
    sr.logits = absl::MakeConstSpan(logits.host).subspan(r * kVocab, kVocab);
    sr.params = &params[r];
    sr.history = &hist[r];
    sr.suppressed_tokens = in[r].suppressed_tokens;
    sr.allowed_bitmask = masks[r];
    sr.position = in[r].position;
    absl::StatusOr<SampleResult> want = cpu.Sample(sr);
    ASSERT_TRUE(want.ok()) << want.status();
    if (!masks[r].empty()) {
      const int32_t t = got[r].ok() ? got[r]->token_id : 0;
      EXPECT_NE((masks[r][t >> 5] >> (t & 31)) & 1u, 0u)
          << "row " << r << " token " << t;
    }
    ASSERT_TRUE(got[r].ok()) << "row " << r << ": " << got[r].status();
    EXPECT_EQ(got[r]->token_id, want->token_id) << "row " << r;
    ExpectLogprob(got[r]->logprob, want->logprob, "row " + std::to_string(r));
    ASSERT_EQ(got[r]->top.size(), want->top.size()) << "row " << r;
    for (size_t k = 0; k < want->top.size(); ++k) {
      EXPECT_EQ(got[r]->top[k].token_id, want->top[k].token_id) << r << "/" << k;
      ExpectLogprob(got[r]->top[k].logprob, want->top[k].logprob,
                    std::to_string(r) + "/" + std::to_string(k));
    }
    if (r % 2 == 0) {
      EXPECT_NE(got[r]->token_id, 7);
      EXPECT_NE(got[r]->token_id, 400);
    }
  }

  // The buffers are reused: a smaller second step on fresh logits.
  DeviceLogits again = Upload(*be, RandomLogits(2, 10));
  ASSERT_TRUE(ds.Prepare(absl::MakeConstSpan(in).subspan(0, 2)).ok());
  ASSERT_TRUE(ds.Run(again.buf.as<float>(), &got).ok());
  ASSERT_EQ(got.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    SampleRequest sr;
    sr.logits = absl::MakeConstSpan(again.host).subspan(r * kVocab, kVocab);
    sr.params = &params[r];
    sr.history = &hist[r];
    sr.suppressed_tokens = in[r].suppressed_tokens;
    sr.allowed_bitmask = masks[r];
    sr.position = in[r].position;
    auto want = cpu.Sample(sr);
    ASSERT_TRUE(want.ok() && got[r].ok());
    EXPECT_EQ(got[r]->token_id, want->token_id) << "row " << r;
  }
}

TEST_P(DeviceSamplerTest, BadRowsFailAloneWithTheHostSamplersErrors) {
  auto be = Open();
  ASSERT_NE(be, nullptr);
  std::vector<float> host = RandomLogits(4, 21);
  host[1 * kVocab + 50] = std::numeric_limits<float>::quiet_NaN();  // row 1: NaN
  for (int i = 0; i < kVocab; ++i) {                                // row 2: all -inf
    host[2 * kVocab + i] = -std::numeric_limits<float>::infinity();
  }
  host.resize(5 * kVocab, 1.0f);
  DeviceLogits logits = Upload(*be, host);
  std::vector<SamplingParams> params(5);
  params[3].temperature = 1.0f;  // row 3: random without a seed
  std::vector<DeviceSampler::Row> in(5);
  for (int r = 0; r < 5; ++r) in[r].params = &params[r];
  // Row 4: a mask whose one allowed token is suppressed.
  std::vector<uint32_t> mask((kVocab + 31) / 32, 0u);
  mask[2] = 1u;  // token 64
  const std::vector<int32_t> suppress64 = {64};
  in[4].allowed_bitmask = mask;
  in[4].suppressed_tokens = suppress64;
  DeviceSampler ds(be.get(), kVocab);
  ASSERT_TRUE(ds.Prepare(in).ok());
  std::vector<absl::StatusOr<SampleResult>> got;
  ASSERT_TRUE(ds.Run(logits.buf.as<float>(), &got).ok());
  ASSERT_EQ(got.size(), 5u);
  Sampler cpu(kVocab);
  for (int r = 0; r < 5; ++r) {
    SampleRequest sr;
    sr.logits = absl::MakeConstSpan(host).subspan(r * kVocab, kVocab);
    sr.params = &params[r];
    sr.allowed_bitmask = in[r].allowed_bitmask;
    sr.suppressed_tokens = in[r].suppressed_tokens;
    absl::StatusOr<SampleResult> want = cpu.Sample(sr);
    EXPECT_EQ(got[r].ok(), want.ok()) << "row " << r;
    if (want.ok()) {
      EXPECT_EQ(got[r]->token_id, want->token_id) << "row " << r;
    } else {
      EXPECT_EQ(got[r].status(), want.status()) << "row " << r;
    }
  }
  EXPECT_TRUE(got[0].ok());
  EXPECT_EQ(got[1].status().message(), "logits contain NaN or +inf");
  EXPECT_EQ(got[2].status().message(), "every token is masked out (all logits -inf)");
  EXPECT_TRUE(absl::IsFailedPrecondition(got[3].status())) << got[3].status();
  EXPECT_EQ(got[4].status().message(),
            "structured output: the constraint allows no next token");
}

// Prompt scoring rows (score_token) beside sampled rows in one launch: each
// scored row gives engine::ScoreToken's result for the raw logits (token, rank,
// logprob, alternatives with ties in id order) and its errors; the sampled
// rows, with their bias and suppression entries around the scored rows' empty
// ones, still give the host sampler's tokens.
TEST_P(DeviceSamplerTest, ScoredRowsGiveScoreTokensResults) {
  auto be = Open();
  ASSERT_NE(be, nullptr);
  constexpr int kRows = 8;
  std::vector<float> host = RandomLogits(kRows, 33);
  // Row 7: two finite logits, so fewer alternatives than asked for.
  for (int i = 0; i < kVocab; ++i) {
    if (i != 40 && i != 41)
      host[7 * kVocab + i] = -std::numeric_limits<float>::infinity();
  }
  // Row 2: three tokens tie at the top; the scored token (20) is one of them.
  for (int id : {10, 20, 30}) host[2 * kVocab + id] = 12.0f;
  host[4 * kVocab + 9] = std::numeric_limits<float>::quiet_NaN();  // row 4
  for (int i = 0; i < kVocab; ++i) {                               // row 5
    host[5 * kVocab + i] = -std::numeric_limits<float>::infinity();
  }
  DeviceLogits logits = Upload(*be, host);
  std::vector<SamplingParams> params(kRows);
  params[0].logprobs = true;
  params[0].top_logprobs = 3;
  params[0].logit_bias = {{7, 40.0f}};  // row 0 takes token 7
  params[3].logprobs = true;
  params[6].logit_bias = {{8, 40.0f}};
  const std::vector<int32_t> suppress = {8};  // row 3: suppressed 8
  std::vector<DeviceSampler::Row> in(kRows);
  for (int r = 0; r < kRows; ++r) in[r].params = &params[r];
  in[3].suppressed_tokens = suppress;
  struct Scored {
    int row;
    int32_t token, top;
  };
  const Scored scored[] = {{1, 5, 0}, {2, 20, 20}, {4, 3, 2}, {5, 3, 2}, {7, 41, 5}};
  for (const Scored& sc : scored) {
    in[sc.row].score_token = sc.token;
    in[sc.row].score_top = sc.top;
    in[sc.row].params = nullptr;  // ignored for a scored row
  }
  DeviceSampler ds(be.get(), kVocab);
  ASSERT_TRUE(ds.Prepare(in).ok());
  std::vector<absl::StatusOr<SampleResult>> got;
  ASSERT_TRUE(ds.Run(logits.buf.as<float>(), &got).ok());
  ASSERT_EQ(got.size(), static_cast<size_t>(kRows));
  for (const Scored& sc : scored) {
    const auto row = absl::MakeConstSpan(host).subspan(sc.row * kVocab, kVocab);
    absl::StatusOr<SampleResult> want = ScoreToken(row, sc.token, sc.top);
    const std::string what = absl::StrCat("scored row ", sc.row);
    ASSERT_EQ(got[sc.row].ok(), want.ok()) << what << ": " << got[sc.row].status();
    if (!want.ok()) {
      EXPECT_EQ(got[sc.row].status(), want.status()) << what;
      continue;
    }
    EXPECT_EQ(got[sc.row]->token_id, sc.token) << what;
    EXPECT_EQ(got[sc.row]->rank, want->rank) << what;
    // The host sums the softmax in one double pass, the device as the sampler
    // does (256-token float chunks): the same value to ~1e-7.
    EXPECT_NEAR(got[sc.row]->logprob, want->logprob, 1e-5) << what;
    ASSERT_EQ(got[sc.row]->top.size(), want->top.size()) << what;
    for (size_t k = 0; k < want->top.size(); ++k) {
      EXPECT_EQ(got[sc.row]->top[k].token_id, want->top[k].token_id)
          << what << " " << k;
      EXPECT_NEAR(got[sc.row]->top[k].logprob, want->top[k].logprob, 1e-5)
          << what << " " << k;
    }
  }
  // The tie: rank 1, the alternatives in id order.
  ASSERT_TRUE(got[2].ok());
  EXPECT_EQ(got[2]->rank, 1);
  EXPECT_EQ(got[2]->top[0].token_id, 10);
  EXPECT_EQ(got[2]->top[1].token_id, 20);
  EXPECT_EQ(got[2]->top[2].token_id, 30);
  EXPECT_EQ(got[4].status().message(), "logits contain NaN or +inf");
  EXPECT_EQ(got[5].status().message(), "every logit is -inf");
  // The sampled rows, as the host sampler.
  Sampler cpu(kVocab);
  for (int r : {0, 3, 6}) {
    SampleRequest sr;
    sr.logits = absl::MakeConstSpan(host).subspan(r * kVocab, kVocab);
    sr.params = &params[r];
    sr.suppressed_tokens = in[r].suppressed_tokens;
    absl::StatusOr<SampleResult> want = cpu.Sample(sr);
    ASSERT_TRUE(want.ok() && got[r].ok()) << r;
    EXPECT_EQ(got[r]->token_id, want->token_id) << "row " << r;
    EXPECT_EQ(got[r]->rank, 0) << "row " << r;  // sampled rows carry no rank
  }
  EXPECT_EQ(got[0]->token_id, 7);
  EXPECT_EQ(got[6]->token_id, 8);
  EXPECT_NE(got[3]->token_id, 8);
  // What it refuses (at Prepare: the logits stay for the host): a token outside
  // the vocabulary, more alternatives than the API allows.
  std::vector<DeviceSampler::Row> bad(1);
  bad[0].score_token = kVocab;
  EXPECT_TRUE(absl::IsInvalidArgument(ds.Prepare(bad))) << ds.Prepare(bad);
  bad[0].score_token = 0;
  bad[0].score_top = kMaxTopLogprobs + 1;
  EXPECT_TRUE(absl::IsInvalidArgument(ds.Prepare(bad)));
}

TEST_P(DeviceSamplerTest, RefusesWhatItCannotSample) {
  auto be = Open();
  ASSERT_NE(be, nullptr);
  DeviceSampler ds(be.get(), kVocab);
  std::vector<absl::StatusOr<SampleResult>> got;
  // Run before any Prepare (rows were never packed).
  SamplingParams p;
  DeviceSampler::Row row;
  row.params = &p;
  DeviceLogits logits = Upload(*be, RandomLogits(1, 1));
  // A row without parameters, and too many alternatives.
  DeviceSampler::Row none;
  absl::Status st = ds.Prepare({&none, 1});
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_TRUE(absl::IsFailedPrecondition(ds.Run(logits.buf.as<float>(), &got)));
  SamplingParams many;
  many.logprobs = true;
  many.top_logprobs = 21;
  DeviceSampler::Row big;
  big.params = &many;
  st = ds.Prepare({&big, 1});
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("top_logprobs 21"), std::string::npos) << st;
  // A token bitmask shorter than the vocabulary.
  const std::vector<uint32_t> short_mask(3, ~0u);
  DeviceSampler::Row short_row = row;
  short_row.allowed_bitmask = short_mask;
  st = ds.Prepare({&short_row, 1});
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("bitmask has 3 words"), std::string::npos) << st;
  // No logits.
  ASSERT_TRUE(ds.Prepare({&row, 1}).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(ds.Run(nullptr, &got)));
  // One Run per Prepare.
  ASSERT_TRUE(ds.Prepare({&row, 1}).ok());
  ASSERT_TRUE(ds.Run(logits.buf.as<float>(), &got).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(ds.Run(logits.buf.as<float>(), &got)));
  // A vocabulary larger than one launch takes.
  DeviceSampler huge(be.get(), kernels::kSamplingMaxVocab + 1);
  EXPECT_TRUE(absl::IsInvalidArgument(huge.Prepare({&row, 1})));
  // A host backend samples its logits in place on the host instead.
  auto cpu = kernels::CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  DeviceSampler on_host(cpu->get(), kVocab);
  st = on_host.Prepare({&row, 1});
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find("does not sample on its device"), std::string::npos)
      << st;
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceSamplerTest,
                         ::testing::ValuesIn(DeviceBackends()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(DeviceSamplerTest);

}  // namespace
}  // namespace tandem::engine
