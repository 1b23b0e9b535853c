// The sampling kernels (sampling.cu) on the SIMT emulator against the CPU
// sampler, which is their contract (engine/sampling: Sampler, RejectionSample,
// GreedyVerify, CounterUniform). Under the emulator device memory is host
// memory, so the launchers run on host vectors.
//
// Bounds: chosen tokens, accept/reject decisions, emitted tokens and top-n ids
// IDENTICAL; logprobs within 1e-5; distributions within 1e-6 relative. Every
// test runs under several emulator seeds (thread and block order shuffled; the
// sampling seed is separate).
#include "kernels/cuda/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/sampling/counter_rng.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/rejection_sampler.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One row of a test batch, in the CPU sampler's terms.
struct Row {
  std::vector<float> logits;
  engine::SamplingParams params;
  engine::PenaltyState history;
  bool has_history = false;
  std::vector<int32_t> suppressed;
  // Structured output: the allowed-token bitmask (empty: none).
  std::vector<uint32_t> mask;
  int64_t position = 0;
};

struct GpuOut {
  std::vector<int32_t> tokens, status;
  std::vector<float> logprobs;
  std::vector<int32_t> top_ids;
  std::vector<float> top_lps;
  std::vector<float> probs;
  int32_t error = 0;
};

constexpr int kStride = kSamplingMaxTopLogprobs;

GpuOut RunGpu(const std::vector<Row>& rows, int vocab, bool exact_replay = false,
              bool want_probs = false) {
  const int n = static_cast<int>(rows.size());
  std::vector<float> logits;
  std::vector<SamplingRowParams> params(n);
  std::vector<int32_t> pen_off{0}, pen_tok, pen_cnt, sup_off{0}, sup_tok, bias_off{0},
      bias_tok;
  std::vector<float> bias_val;
  std::vector<uint8_t> pen_prompt;
  std::vector<uint32_t> masks;
  const int32_t mask_words = (vocab + 31) / 32;
  int32_t mask_count = 0;
  for (int r = 0; r < n; ++r) {
    const Row& row = rows[r];
    if (!row.mask.empty()) {
      EXPECT_EQ(static_cast<int32_t>(row.mask.size()), mask_words);
      params[r].mask_row = mask_count++;
      masks.insert(masks.end(), row.mask.begin(), row.mask.end());
    }
    logits.insert(logits.end(), row.logits.begin(), row.logits.end());
    const engine::SamplingParams& p = row.params;
    SamplingRowParams& g = params[r];
    g.temperature = p.temperature;
    g.top_p = p.top_p;
    g.min_p = p.min_p;
    g.top_k = p.top_k;
    g.presence_penalty = p.presence_penalty;
    g.frequency_penalty = p.frequency_penalty;
    g.repetition_penalty = p.repetition_penalty;
    g.logprobs = p.logprobs ? 1 : 0;
    g.top_logprobs = p.top_logprobs;
    g.has_seed = p.seed.has_value() ? 1 : 0;
    g.seed = p.seed.value_or(0);
    g.position = row.position;
    if (row.has_history) {
      std::vector<int32_t> ids(row.history.prompt_tokens().begin(),
                               row.history.prompt_tokens().end());
      for (const auto& [id, c] : row.history.output_counts()) {
        if (!row.history.prompt_tokens().contains(id)) ids.push_back(id);
      }
      for (int32_t id : ids) {
        pen_tok.push_back(id);
        auto it = row.history.output_counts().find(id);
        pen_cnt.push_back(it == row.history.output_counts().end() ? 0 : it->second);
        pen_prompt.push_back(row.history.prompt_tokens().contains(id) ? 1 : 0);
      }
    }
    pen_off.push_back(static_cast<int32_t>(pen_tok.size()));
    sup_tok.insert(sup_tok.end(), row.suppressed.begin(), row.suppressed.end());
    sup_off.push_back(static_cast<int32_t>(sup_tok.size()));
    for (const engine::TokenBias& b : p.logit_bias) {
      bias_tok.push_back(b.token_id);
      bias_val.push_back(b.bias);
    }
    bias_off.push_back(static_cast<int32_t>(bias_tok.size()));
  }
  GpuOut out;
  out.tokens.assign(n, -7);
  out.status.assign(n, -7);
  out.logprobs.assign(n, 0.0f);
  out.top_ids.assign(n * kStride, -7);
  out.top_lps.assign(n * kStride, 0.0f);
  if (want_probs) out.probs.assign(static_cast<size_t>(n) * vocab, -1.0f);
  SampleArgs a;
  a.rows = n;
  a.vocab = vocab;
  a.logits = logits.data();
  a.params = params.data();
  // Empty vectors have no storage: no entries, no CSR.
  a.penalty_offsets = pen_tok.empty() ? nullptr : pen_off.data();
  a.penalty_tokens = pen_tok.data();
  a.penalty_output_counts = pen_cnt.data();
  a.penalty_in_prompt = pen_prompt.data();
  a.suppress_offsets = sup_tok.empty() ? nullptr : sup_off.data();
  a.suppress_tokens = sup_tok.data();
  a.bias_offsets = bias_tok.empty() ? nullptr : bias_off.data();
  a.bias_tokens = bias_tok.data();
  a.bias_values = bias_val.data();
  if (mask_count > 0) {
    a.allowed_bitmask = masks.data();
    a.mask_words = mask_words;
    a.mask_count = mask_count;
  }
  a.token_ids = out.tokens.data();
  a.row_status = out.status.data();
  a.logprobs = out.logprobs.data();
  a.top_n_stride = kStride;
  a.top_ids = out.top_ids.data();
  a.top_logprobs = out.top_lps.data();
  a.probs = want_probs ? out.probs.data() : nullptr;
  a.error_word = &out.error;
  a.debug_exact_replay = exact_replay ? 1 : 0;
  const char* err = LaunchSample(a, nullptr);
  EXPECT_EQ(err, nullptr) << err;
  return out;
}

absl::StatusOr<engine::SampleResult> RunCpu(const Row& row, int vocab) {
  engine::Sampler sampler(vocab);
  engine::SampleRequest req;
  req.logits = row.logits;
  req.params = &row.params;
  req.history = row.has_history ? &row.history : nullptr;
  req.suppressed_tokens = row.suppressed;
  req.allowed_bitmask = row.mask;
  req.position = row.position;
  return sampler.Sample(req);
}

std::string Describe(const Row& row) {
  const engine::SamplingParams& p = row.params;
  return "t=" + std::to_string(p.temperature) + " k=" + std::to_string(p.top_k) +
         " p=" + std::to_string(p.top_p) + " min_p=" + std::to_string(p.min_p) +
         " rep=" + std::to_string(p.repetition_penalty) +
         " freq=" + std::to_string(p.frequency_penalty) +
         " pres=" + std::to_string(p.presence_penalty) +
         " bias=" + std::to_string(p.logit_bias.size()) +
         " pos=" + std::to_string(row.position) +
         " seed=" + std::to_string(p.seed.value_or(0));
}

// Tokens identical, logprobs within 1e-5, top-n ids identical.
void ExpectSameAsCpu(const std::vector<Row>& rows, int vocab, const GpuOut& g) {
  for (size_t r = 0; r < rows.size(); ++r) {
    absl::StatusOr<engine::SampleResult> want = RunCpu(rows[r], vocab);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(g.status[r], kSampleOk) << "row " << r;
    ASSERT_EQ(g.tokens[r], want->token_id) << "row " << r << " " << Describe(rows[r]);
    if (!rows[r].params.logprobs) continue;
    EXPECT_NEAR(g.logprobs[r], want->logprob, 1e-5) << "row " << r;
    const int n = rows[r].params.top_logprobs;
    ASSERT_LE(static_cast<int>(want->top.size()), n);
    for (int j = 0; j < n; ++j) {
      if (j < static_cast<int>(want->top.size())) {
        EXPECT_EQ(g.top_ids[r * kStride + j], want->top[j].token_id)
            << "row " << r << " j " << j;
        EXPECT_NEAR(g.top_lps[r * kStride + j], want->top[j].logprob, 1e-5);
      } else {
        EXPECT_EQ(g.top_ids[r * kStride + j], -1);
      }
    }
  }
}

class Sampling : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    saved_seed_ = cuda_sim::Seed();
    cuda_sim::SetSeed(GetParam());
    rng_.seed(77 + static_cast<uint32_t>(GetParam()));
  }
  void TearDown() override { cuda_sim::SetSeed(saved_seed_); }

  std::vector<float> Logits(int vocab, float sd) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(vocab);
    for (float& x : v) x = d(rng_);
    return v;
  }
  uint64_t Seed() { return (static_cast<uint64_t>(rng_()) << 32) | rng_(); }
  int64_t Position() { return std::uniform_int_distribution<int64_t>(0, 5000)(rng_); }

  // A mixed batch: every parameter kind, with and without history.
  std::vector<Row> MixedBatch(int vocab, int rows) {
    std::vector<Row> out(rows);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    for (int r = 0; r < rows; ++r) {
      Row& row = out[r];
      const float sd = std::vector<float>{0.3f, 1.0f, 3.0f, 8.0f}[r % 4];
      row.logits = Logits(vocab, sd);
      engine::SamplingParams& p = row.params;
      p.seed = Seed();
      row.position = Position();
      switch (r % 12) {
        case 0:  // greedy
          p.temperature = 0.0f;
          break;
        case 1:  // plain
          p.temperature = 1.0f;
          break;
        case 2:
          p.temperature = 0.7f;
          break;
        case 3:
          p.temperature = 1.3f;
          p.top_k = 1 + static_cast<int>(rng_() % 60);
          break;
        case 4:
          p.temperature = 0.9f;
          p.top_p = 0.05f + 0.9f * uni(rng_);
          break;
        case 5:
          p.temperature = 1.0f;
          p.min_p = 0.02f + 0.3f * uni(rng_);
          break;
        case 6:
          p.temperature = 0.8f;
          p.top_k = 1 + static_cast<int>(rng_() % 200);
          p.top_p = 0.3f + 0.6f * uni(rng_);
          break;
        case 7:
          p.temperature = 1.1f;
          p.top_k = 40;
          p.top_p = 0.9f;
          p.min_p = 0.05f;
          break;
        case 8:
          p.temperature = 1.0f;
          p.top_p = 0.7f;
          p.min_p = 0.1f;
          break;
        case 9:
          p.temperature = 1.0f;
          p.top_k = 1;
          break;
        case 10:
          p.temperature = 0.6f;
          p.top_p = 1e-6f;  // tiny: the top token alone
          break;
        case 11:
          p.temperature = 2.0f;
          p.top_k = 5;
          p.min_p = 0.2f;
          break;
      }
      if (r % 3 == 1 || r % 24 == 12) {  // penalties with a token history (greedy too)
        p.repetition_penalty = 1.0f + 0.5f * uni(rng_);
        p.frequency_penalty = 0.5f * uni(rng_);
        p.presence_penalty = 0.5f * uni(rng_);
        row.has_history = true;
        std::vector<int32_t> prompt, output;
        for (int i = 0; i < 30; ++i) prompt.push_back(rng_() % vocab);
        for (int i = 0; i < 25; ++i) output.push_back(rng_() % (vocab / 10));
        // Make the top tokens part of the history, where penalties matter.
        const int32_t top = static_cast<int32_t>(
            std::max_element(row.logits.begin(), row.logits.end()) -
            row.logits.begin());
        output.push_back(top);
        output.push_back(top);
        row.history.AddPromptTokens(prompt);
        row.history.AddOutputTokens(output);
      }
      if (r % 5 == 2) {  // suppressed tokens, including the top one
        const int32_t top = static_cast<int32_t>(
            std::max_element(row.logits.begin(), row.logits.end()) -
            row.logits.begin());
        row.suppressed = {top, static_cast<int32_t>(rng_() % vocab), top};
      }
      if (r % 4 == 3 || r % 24 == 12) {
        // logit_bias: the top token pushed down, a random one up (enough to
        // win at the larger spreads' scale now and then), one nudged; some of
        // them also in the history or suppressed (the order of operations).
        const int32_t top = static_cast<int32_t>(
            std::max_element(row.logits.begin(), row.logits.end()) -
            row.logits.begin());
        std::map<int32_t, float> bias{
            {top, -5.0f - 10.0f * uni(rng_)},
            {static_cast<int32_t>(rng_() % vocab), 8.0f + 20.0f * uni(rng_)},
            {static_cast<int32_t>(rng_() % vocab), 0.5f}};
        for (const auto& [id, b] : bias) p.logit_bias.push_back({id, b});
      }
      if (r % 2 == 0) {
        p.logprobs = true;
        p.top_logprobs = static_cast<int32_t>(rng_() % (kSamplingMaxTopLogprobs + 1));
      }
      if (r % 7 == 3) {  // a grammar's mask: whole words, scattered bits, the top out
        row.mask.assign((vocab + 31) / 32, 0u);
        for (size_t w = 0; w < row.mask.size(); ++w) {
          const uint32_t kind = rng_() % 4;
          row.mask[w] = kind == 0 ? ~0u : kind == 1 ? (rng_() & rng_() & rng_()) : 0u;
        }
        const int32_t top = static_cast<int32_t>(
            std::max_element(row.logits.begin(), row.logits.end()) -
            row.logits.begin());
        row.mask[top >> 5] &= ~(1u << (top & 31));
        const int32_t keep = static_cast<int32_t>(rng_() % vocab);
        row.mask[keep >> 5] |= 1u << (keep & 31);
      }
    }
    return out;
  }

  std::mt19937 rng_;
  uint64_t saved_seed_ = 0;
};

TEST(SamplingRng, CounterUniformIsTheCpuFunction) {
  std::mt19937_64 g(5);
  for (int i = 0; i < 2000; ++i) {
    const uint64_t seed = g();
    const int64_t pos = static_cast<int64_t>(g() % 100000) - (i % 7 == 0 ? 50 : 0);
    for (uint32_t stream = 0; stream < 3; ++stream) {
      EXPECT_EQ(CounterUniform(seed, pos, stream, i % 3),
                engine::CounterUniform(seed, pos,
                                       static_cast<engine::RngStream>(stream), i % 3));
    }
  }
}

TEST_P(Sampling, MixedBatchMatchesCpu) {
  constexpr int kVocab = 1000;
  for (int round = 0; round < 3; ++round) {
    const std::vector<Row> rows = MixedBatch(kVocab, 48);
    const GpuOut g = RunGpu(rows, kVocab);
    EXPECT_EQ(g.error, 0);
    ExpectSameAsCpu(rows, kVocab, g);
  }
}

// The exact sequential replay (taken near CDF steps) chooses the same tokens.
TEST_P(Sampling, ExactReplayMatchesCpu) {
  constexpr int kVocab = 700;
  const std::vector<Row> rows = MixedBatch(kVocab, 24);
  ExpectSameAsCpu(rows, kVocab, RunGpu(rows, kVocab, /*exact_replay=*/true));
}

// Many draws of one row: every position's token equals the CPU's.
TEST_P(Sampling, ManySeedsOneRow) {
  constexpr int kVocab = 300;
  const std::vector<float> logits = Logits(kVocab, 1.5f);
  std::vector<Row> rows;
  for (int i = 0; i < 64; ++i) {
    Row row;
    row.logits = logits;
    row.params.temperature = 1.0f;
    row.params.top_p = i % 2 ? 0.8f : 1.0f;
    row.params.top_k = i % 4 >= 2 ? 50 : 0;
    row.params.seed = 1234 + i / 8;
    row.position = i;
    rows.push_back(std::move(row));
  }
  ExpectSameAsCpu(rows, kVocab, RunGpu(rows, kVocab));
}

// Ties: greedy goes to the lowest id; rankings break ties by lower id.
TEST_P(Sampling, TiesAndFlatRows) {
  constexpr int kVocab = 600;
  std::vector<Row> rows;
  for (int i = 0; i < 16; ++i) {
    Row row;
    row.logits.resize(kVocab);
    // Few distinct values: many exact ties, at the top too.
    for (int v = 0; v < kVocab; ++v)
      row.logits[v] = static_cast<float>((v * 7 + i) % 5) - 2.0f;
    if (i % 4 == 3) std::fill(row.logits.begin(), row.logits.end(), 0.5f);  // flat
    if (i % 4 == 2) row.logits[3] = -0.0f, row.logits[9] = 0.0f;
    row.params.seed = Seed();
    row.position = Position();
    row.params.logprobs = true;
    row.params.top_logprobs = 20;
    switch (i % 8) {
      case 0:
        row.params.temperature = 0.0f;
        break;
      case 1:
        row.params.temperature = 1.0f;
        row.params.top_k = 7;
        break;
      case 2:
        row.params.temperature = 1.0f;
        row.params.top_p = 0.3f;
        break;
      case 3:
        row.params.temperature = 1.0f;
        row.params.top_k = 100;
        row.params.top_p = 0.5f;
        break;
      case 4:
        row.params.temperature = 1.0f;
        row.params.min_p = 0.5f;
        break;
      case 5:
        row.params.temperature = 0.5f;
        row.params.top_k = 1;
        break;
      case 6:
        row.params.temperature = 1.0f;
        break;
      case 7:
        row.params.temperature = 1e-6f;  // below kGreedyTemperature: greedy
        break;
    }
    rows.push_back(std::move(row));
  }
  const GpuOut g = RunGpu(rows, kVocab);
  ExpectSameAsCpu(rows, kVocab, g);
  // Greedy rows: the lowest id among the maxima.
  EXPECT_EQ(g.tokens[0], std::find(rows[0].logits.begin(), rows[0].logits.end(), 2.0f) -
                             rows[0].logits.begin());
}

// Cuts exactly at the end of a group of equal logits, and one past it: top-k
// with k = group size (+1), top-p whose target falls inside the group's last
// (or the next group's first) token.
TEST_P(Sampling, CutsAtTieGroupEdges) {
  constexpr int kVocab = 600, kGroup = 150;
  std::vector<float> logits(kVocab);
  for (int v = 0; v < kVocab; ++v) logits[v] = 2.0f - static_cast<float>((v * 7) % 4);
  double w[4];
  for (int g = 0; g < 4; ++g) w[g] = std::exp(static_cast<float>(-g));
  const double total = kGroup * (w[0] + w[1] + w[2] + w[3]);
  std::vector<Row> rows;
  auto add = [&](int top_k, double top_p) {
    Row row;
    row.logits = logits;
    row.params.temperature = 1.0f;
    row.params.top_k = top_k;
    row.params.top_p = static_cast<float>(top_p);
    row.params.seed = Seed();
    row.position = Position();
    rows.push_back(row);
  };
  for (int rep = 0; rep < 4; ++rep) {
    add(kGroup, 1.0);
    add(kGroup + 1, 1.0);
    add(2 * kGroup, 1.0);
    add(0, (kGroup * w[0] + (kGroup - 0.5) * w[1]) / total);
    add(0, (kGroup * w[0] + kGroup * w[1] + 0.5 * w[2]) / total);
    add(0, (kGroup - 0.5) * w[0] / total);
    add(2 * kGroup + 1,
        (kGroup * w[0] + (kGroup - 0.5) * w[1]) / (kGroup * (w[0] + w[1]) + w[2]));
  }
  const GpuOut g = RunGpu(rows, kVocab, false, /*want_probs=*/true);
  ExpectSameAsCpu(rows, kVocab, g);
  // The kept sets too (through the distributions).
  for (size_t r = 0; r < rows.size(); ++r) {
    engine::Sampler sampler(kVocab);
    engine::SampleRequest req;
    req.logits = rows[r].logits;
    req.params = &rows[r].params;
    std::vector<float> want;
    ASSERT_TRUE(sampler.Distribution(req, &want).ok());
    int kept = 0;
    for (int i = 0; i < kVocab; ++i) {
      ASSERT_EQ(g.probs[r * kVocab + i] == 0.0f, want[i] == 0.0f)
          << "row " << r << " id " << i;
      kept += want[i] > 0.0f;
    }
    const int expect_kept[] = {kGroup,         kGroup + 1, 2 * kGroup, 2 * kGroup,
                               2 * kGroup + 1, kGroup,     2 * kGroup};
    EXPECT_EQ(kept, expect_kept[r % 7]) << "row " << r;
  }
}

// Selection first looks within 16 nats of the max; these rows need the tail
// (top-k and top-n larger than the window, top-p whose target is past its
// mass).
TEST_P(Sampling, SelectionBeyondTheWindow) {
  constexpr int kVocab = 1000;
  std::vector<Row> rows;
  for (int i = 0; i < 12; ++i) {
    Row row;
    row.logits.assign(kVocab, -17.0f);
    for (int v = 0; v < 10; ++v) row.logits[(v * 37 + i) % kVocab] = 0.5f * (v % 3);
    for (int v = 0; v < kVocab; v += 9) row.logits[v] -= 0.25f * (v % 4);
    row.logits[(i * 101) % kVocab] = kNegInf;
    row.params.temperature = 1.0f;
    row.params.seed = Seed();
    row.position = Position();
    row.params.logprobs = true;
    row.params.top_logprobs = 20;
    switch (i % 4) {
      case 0:
        row.params.top_k = 50;
        break;
      case 1:
        row.params.top_p = 0.999999f;
        break;
      case 2:
        row.params.top_k = 500;
        row.params.top_p = 0.999999f;
        break;
      case 3:
        row.params.top_p = 0.999999f;
        row.params.min_p = 1e-8f;
        break;
    }
    rows.push_back(std::move(row));
  }
  const GpuOut g = RunGpu(rows, kVocab, false, /*want_probs=*/true);
  ExpectSameAsCpu(rows, kVocab, g);
  for (size_t r = 0; r < rows.size(); ++r) {
    engine::Sampler sampler(kVocab);
    engine::SampleRequest req;
    req.logits = rows[r].logits;
    req.params = &rows[r].params;
    std::vector<float> want;
    ASSERT_TRUE(sampler.Distribution(req, &want).ok());
    int kept = 0;
    for (int i = 0; i < kVocab; ++i) {
      ASSERT_EQ(g.probs[r * kVocab + i] == 0.0f, want[i] == 0.0f)
          << "row " << r << " id " << i;
      kept += want[i] > 0.0f;
    }
    EXPECT_GT(kept, 10) << "row " << r;  // the tail is in play
  }
}

// Distribution (the rows speculative decoding feeds the rejection sampler).
TEST_P(Sampling, DistributionMatchesCpu) {
  constexpr int kVocab = 500;
  const std::vector<Row> rows = MixedBatch(kVocab, 24);
  const GpuOut g = RunGpu(rows, kVocab, false, /*want_probs=*/true);
  for (size_t r = 0; r < rows.size(); ++r) {
    engine::Sampler sampler(kVocab);
    engine::SampleRequest req;
    req.logits = rows[r].logits;
    req.params = &rows[r].params;
    req.history = rows[r].has_history ? &rows[r].history : nullptr;
    req.suppressed_tokens = rows[r].suppressed;
    req.allowed_bitmask = rows[r].mask;
    req.position = rows[r].position;
    std::vector<float> want;
    ASSERT_TRUE(sampler.Distribution(req, &want).ok());
    for (int i = 0; i < kVocab; ++i) {
      const float got = g.probs[r * kVocab + i];
      ASSERT_EQ(got == 0.0f, want[i] == 0.0f) << "row " << r << " id " << i;
      ASSERT_NEAR(got, want[i], 1e-6 * want[i] + 1e-30) << "row " << r << " id " << i;
    }
  }
}

// K3's vocabulary: one row each of top-k + top-p, plain, min-p.
TEST_P(Sampling, K3Vocabulary) {
  constexpr int kVocab = 163840;
  std::vector<Row> rows(3);
  for (int r = 0; r < 3; ++r) {
    rows[r].logits = Logits(kVocab, 2.5f);
    rows[r].params.seed = Seed();
    rows[r].position = Position();
    rows[r].params.temperature = 0.8f;
    rows[r].params.logprobs = true;
    rows[r].params.top_logprobs = 5;
  }
  rows[0].params.top_k = 50;
  rows[0].params.top_p = 0.9f;
  rows[2].params.min_p = 0.05f;
  ExpectSameAsCpu(rows, kVocab, RunGpu(rows, kVocab));
}

TEST_P(Sampling, BadRowsAndIds) {
  constexpr int kVocab = 256;
  std::vector<Row> rows(4);
  for (Row& row : rows) {
    row.logits = Logits(kVocab, 1.0f);
    row.params.temperature = 1.0f;
    row.params.seed = 3;
  }
  rows[0].logits[17] = std::numeric_limits<float>::quiet_NaN();
  rows[1].logits.assign(kVocab, kNegInf);
  rows[2].params.seed.reset();
  rows[3].suppressed = {5, kVocab + 3};  // out of range: skipped, recorded
  // A mask whose only allowed token is suppressed: the CPU's "the constraint
  // allows no next token"; a mask allowing only a NaN: bad logits, as there.
  rows.resize(6);
  for (int r : {4, 5}) {
    rows[r].logits = Logits(kVocab, 1.0f);
    rows[r].mask.assign(kVocab / 32, 0u);
    rows[r].mask[1] = 1u << 3;  // token 35
  }
  rows[4].suppressed = {35};
  rows[5].logits[35] = std::numeric_limits<float>::quiet_NaN();
  const GpuOut g = RunGpu(rows, kVocab);
  EXPECT_EQ(g.status[4], kSampleNoAllowedToken);
  EXPECT_EQ(g.tokens[4], -1);
  EXPECT_EQ(RunCpu(rows[4], kVocab).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(g.status[5], kSampleBadLogits);
  EXPECT_EQ(RunCpu(rows[5], kVocab).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.status[0], kSampleBadLogits);
  EXPECT_EQ(g.status[1], kSampleAllMasked);
  EXPECT_EQ(g.status[2], kSampleNoSeed);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g.tokens[r], -1);
  EXPECT_EQ(g.status[3], kSampleOk);
  EXPECT_EQ(g.error, kTokenIdOutOfRange);
  absl::StatusOr<engine::SampleResult> want = RunCpu(rows[3], kVocab);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(g.tokens[3], want->token_id);
}

// ---- Speculative decoding -----------------------------------------------------------
struct SpecCase {
  std::vector<float> target, draft;  // [K + 1, V], [K, V]
  std::vector<int32_t> tokens;       // [K]
  int32_t num_drafts;
  uint64_t seed;
  int64_t position;
};

TEST_P(Sampling, RejectionSamplerMatchesCpu) {
  constexpr int kVocab = 400, kK = 4, kRequests = 40;
  std::vector<SpecCase> cases(kRequests);
  auto softmax = [&](float sd, float* out) {
    std::vector<float> l = Logits(kVocab, sd);
    const float m = *std::max_element(l.begin(), l.end());
    double s = 0;
    for (float& v : l) s += (v = std::exp(v - m));
    for (int i = 0; i < kVocab; ++i) out[i] = static_cast<float>(l[i] / s);
  };
  for (int r = 0; r < kRequests; ++r) {
    SpecCase& c = cases[r];
    c.target.resize((kK + 1) * kVocab);
    c.draft.resize(kK * kVocab);
    c.num_drafts = r % 5 == 4 ? static_cast<int32_t>(rng_() % (kK + 1)) : kK;
    c.seed = Seed();
    c.position = Position();
    for (int j = 0; j <= kK; ++j) softmax(r % 2 ? 1.0f : 3.0f, &c.target[j * kVocab]);
    for (int j = 0; j < kK; ++j) {
      float* q = &c.draft[j * kVocab];
      if (r % 7 == 3) {
        std::copy_n(&c.target[j * kVocab], kVocab, q);  // p == q: always accepts
      } else if (r % 7 == 5 && j == 1) {
        std::fill(q, q + kVocab, 0.0f);  // a truncated draft row: q(d) may be 0
        for (int i = 0; i < 10; ++i) q[i] = 0.1f;
      } else {
        softmax(2.0f, q);
      }
      // The drafted token: from the draft's likely tokens, sometimes arbitrary.
      const float* qq = q;
      c.tokens.push_back(
          r % 3 == 0 ? static_cast<int32_t>(rng_() % kVocab)
                     : static_cast<int32_t>(std::max_element(qq, qq + kVocab) - qq));
    }
    // Rows where the target is one-hot (greedy-like target distributions).
    if (r % 11 == 6) {
      for (int j = 0; j <= kK; ++j) {
        std::fill(&c.target[j * kVocab], &c.target[(j + 1) * kVocab], 0.0f);
        c.target[j * kVocab + (j * 13 + r) % kVocab] = 1.0f;
      }
    }
  }
  for (bool replay : {false, true}) {
    std::vector<float> target, draft;
    std::vector<int32_t> tokens, nd;
    std::vector<uint64_t> seeds;
    std::vector<int64_t> positions;
    for (const SpecCase& c : cases) {
      target.insert(target.end(), c.target.begin(), c.target.end());
      draft.insert(draft.end(), c.draft.begin(), c.draft.end());
      tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
      nd.push_back(c.num_drafts);
      seeds.push_back(c.seed);
      positions.push_back(c.position);
    }
    std::vector<int32_t> accepted(kRequests, -7), next(kRequests, -7);
    int32_t error = 0;
    RejectionArgs a;
    a.requests = kRequests;
    a.vocab = kVocab;
    a.max_drafts = kK;
    a.target_probs = target.data();
    a.draft_probs = draft.data();
    a.draft_tokens = tokens.data();
    a.num_drafts = nd.data();
    a.seeds = seeds.data();
    a.first_positions = positions.data();
    a.num_accepted = accepted.data();
    a.next_token = next.data();
    a.error_word = &error;
    a.debug_exact_replay = replay ? 1 : 0;
    ASSERT_EQ(LaunchRejectionSample(a, nullptr), nullptr);
    EXPECT_EQ(error, 0);
    int rejections = 0;
    for (int r = 0; r < kRequests; ++r) {
      const SpecCase& c = cases[r];
      const int n = c.num_drafts;
      // The CPU sees exactly n drafts and n + 1 target rows.
      std::vector<float> t(c.target.begin(), c.target.begin() + (n + 1) * kVocab);
      std::vector<float> q(c.draft.begin(), c.draft.begin() + n * kVocab);
      std::vector<int32_t> d(c.tokens.begin(), c.tokens.begin() + n);
      absl::StatusOr<engine::SpecVerifyResult> want =
          engine::RejectionSample(t, q, d, kVocab, c.seed, c.position);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(accepted[r], want->num_accepted) << "request " << r;
      EXPECT_EQ(next[r], want->next_token) << "request " << r;
      rejections += want->num_accepted < n;
    }
    EXPECT_GT(rejections, 5);  // both branches exercised
  }
}

TEST_P(Sampling, GreedyVerifyMatchesCpu) {
  constexpr int kK = 5, kRequests = 70;
  std::vector<int32_t> argmax, drafts, nd;
  for (int r = 0; r < kRequests; ++r) {
    for (int j = 0; j <= kK; ++j) argmax.push_back(rng_() % 4);
    for (int j = 0; j < kK; ++j)
      drafts.push_back(rng_() % 2 ? argmax[r * (kK + 1) + j] : rng_() % 4);
    nd.push_back(rng_() % (kK + 1));
  }
  std::vector<int32_t> accepted(kRequests), next(kRequests);
  ASSERT_EQ(LaunchGreedyVerify(kRequests, kK, argmax.data(), drafts.data(), nd.data(),
                               accepted.data(), next.data(), nullptr),
            nullptr);
  for (int r = 0; r < kRequests; ++r) {
    std::vector<int32_t> t(argmax.begin() + r * (kK + 1),
                           argmax.begin() + r * (kK + 1) + nd[r] + 1);
    std::vector<int32_t> d(drafts.begin() + r * kK, drafts.begin() + r * kK + nd[r]);
    absl::StatusOr<engine::SpecVerifyResult> want = engine::GreedyVerify(t, d);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(accepted[r], want->num_accepted);
    EXPECT_EQ(next[r], want->next_token);
  }
}

INSTANTIATE_TEST_SUITE_P(EmulatorSeeds, Sampling, ::testing::Values(1, 7, 20261201));

}  // namespace
}  // namespace tandem::kernels::cuda
