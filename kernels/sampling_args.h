// The arguments of token sampling on a device (Backend::SampleTokens, and the
// CUDA kernels behind it: kernels/cuda/sampling.h, whose comment holds the
// design and the exactness contract). Plain C++ (no absl, no CUDA): nvcc
// compiles it with the kernels, the engine fills it (engine/runtime:
// DeviceSampler). Every pointer is device memory of the backend; scalars are
// host values.
#ifndef TANDEM_KERNELS_SAMPLING_ARGS_H_
#define TANDEM_KERNELS_SAMPLING_ARGS_H_

#include <cstdint>

namespace tandem::kernels {

// engine::kGreedyTemperature: below it a row is greedy.
constexpr float kSamplingGreedyTemperature = 1e-5f;
// engine::kMaxTopLogprobs.
constexpr int kSamplingMaxTopLogprobs = 20;
// Largest vocabulary one launch takes (shared memory holds 24 bytes per
// 256-token chunk).
constexpr int64_t kSamplingMaxVocab = int64_t{1} << 18;

// One row's parameters (engine::SamplingParams plus the row's output position).
struct SamplingRowParams {
  float temperature = 0.0f;         // < kSamplingGreedyTemperature: greedy
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off
  float presence_penalty = 0.0f;    // output tokens
  float frequency_penalty = 0.0f;   // output tokens, times the count
  float repetition_penalty = 1.0f;  // prompt and output tokens
  int32_t top_k = 0;                // 0 (or >= vocab): off
  int32_t top_logprobs = 0;         // alternatives to report (<= top_n_stride)
  int32_t logprobs = 0;             // nonzero: report the chosen token's logprob
  int32_t has_seed = 0;             // random sampling needs a seed
  // Structured output: the row's allowed-token mask, a row of
  // SampleArgs::allowed_bitmask; -1: no mask.
  int32_t mask_row = -1;
  // Prompt scoring (prompt logprobs, engine::ScoreToken's twin): >= 0 names the
  // token the row is scored for instead of sampling one. The row's logits are
  // taken raw (the packer gives it no mask, bias, penalty or suppression
  // entries and temperature 1); token_ids gets this token, logprobs its
  // log-softmax, ranks its rank, top_ids / top_logprobs the top_logprobs most
  // likely tokens. No seed needed, nothing drawn.
  int32_t score_token = -1;
  uint64_t seed = 0;
  int64_t position = 0;  // output position of the token (RNG counter)
};

enum SampleStatus : int32_t {
  kSampleOk = 0,
  kSampleBadLogits = 1,       // NaN or +inf after processing
  kSampleAllMasked = 2,       // every token -inf
  kSampleNoSeed = 3,          // random sampling without a seed
  kSampleNoAllowedToken = 4,  // the row's mask (and suppression) left no token
};

struct SampleArgs {
  int32_t rows = 0;
  int32_t vocab = 0;
  // [rows, vocab] fp32, row-major. MODIFIED IN PLACE: suppression and penalties
  // are applied to it (temperature is not).
  float* logits = nullptr;
  const SamplingRowParams* params = nullptr;  // [rows]
  // Penalty history, CSR over rows (null offsets: no history). Entry e of row r
  // (offsets[r] <= e < offsets[r+1]) is a DISTINCT token id with its output
  // count (0 when only in the prompt) and whether the prompt holds it
  // (engine::PenaltyState's prompt set and output counts, merged).
  const int32_t* penalty_offsets = nullptr;  // [rows + 1]
  const int32_t* penalty_tokens = nullptr;
  const int32_t* penalty_output_counts = nullptr;
  const uint8_t* penalty_in_prompt = nullptr;
  // logit_bias, CSR over rows (null offsets: no row has one): entry e of row r
  // adds bias_values[e] to token bias_tokens[e]'s logit, after the mask and
  // before the penalties (engine::Sampler's order). A row's ids are DISTINCT.
  const int32_t* bias_offsets = nullptr;  // [rows + 1]
  const int32_t* bias_tokens = nullptr;
  const float* bias_values = nullptr;
  // Structured-output masks (engine::SampleRequest::allowed_bitmask's layout:
  // bit i % 32 of word i / 32 set = token i allowed), [mask_count, mask_words]
  // with mask_words * 32 >= vocab; a row with params.mask_row >= 0 may choose
  // only its mask's tokens (applied before everything else, as on the CPU).
  // Null: no row is masked.
  const uint32_t* allowed_bitmask = nullptr;
  int32_t mask_words = 0;
  int32_t mask_count = 0;
  // Suppressed ids (StopChecker::SuppressedTokens()), CSR over rows; may repeat.
  const int32_t* suppress_offsets = nullptr;  // [rows + 1]
  const int32_t* suppress_tokens = nullptr;
  // Outputs.
  int32_t* token_ids = nullptr;   // [rows]; -1 for a failed row
  int32_t* row_status = nullptr;  // [rows] SampleStatus, or null
  float* logprobs = nullptr;      // [rows] (rows with params.logprobs), or null
  int32_t* ranks = nullptr;  // [rows]: scored rows' 1 + tokens more likely, or null
  // [rows, top_n_stride]: alternatives most likely first; unused columns get id
  // -1 and logprob -inf. Null when no row asks.
  int32_t top_n_stride = 0;
  int32_t* top_ids = nullptr;
  float* top_logprobs = nullptr;
  // Optional [rows, vocab]: the distribution the draw is cut from
  // (engine::Sampler::Distribution; greedy rows one-hot), for speculative
  // decoding. Null: not written.
  float* probs = nullptr;
  int32_t* error_word = nullptr;  // device_errors.h, first error wins
  // Tests: take the exact sequential replay for every draw.
  int32_t debug_exact_replay = 0;
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_SAMPLING_ARGS_H_
