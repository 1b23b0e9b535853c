// Samples a step's rows on the backend's device (Backend::SampleTokens) from
// logits the forward left there (LogitsPlacement::kDevice), so that a decode
// step moves each row's parameters up and its chosen token back instead of
// [rows, vocab] fp32 logits down (64 rows of K3's 163,840-token vocabulary:
// 42 MB per step, against a few kilobytes).
//
// The result is engine::Sampler's for the same logits, parameters, history and
// seed (the kernels' contract, kernels/cuda/sampling.h): the same token, the
// same logprob and top-n alternatives, and the same per-row errors with the
// host sampler's messages (NaN or +inf logits, every token masked out, random
// sampling without a seed).
//
// One call: Prepare packs every row's SamplingRowParams, its penalty history
// (only rows with penalties: each distinct prompt or output token once, with
// its output count and whether the prompt holds it) and its suppressed tokens
// (ids outside the vocabulary dropped, as the host sampler ignores them), its
// logit bias (rows that have one), and the structured-output masks of the rows that
// have one (vocab / 32 words each) into one staging buffer and uploads it in one copy;
// Run launches the kernel on the compute stream, after the forward, and brings the
// outputs (token, row status, logprob, alternatives) back in one copy. The device
// buffers grow to the largest step and are reused.
//
// Steps with speculative drafts are not taken here (verification is host
// code): the engine samples those on the host.
//
// Not thread-safe: one thread at a time (the overlapped step packs on the
// engine's thread, then uploads and runs on its device thread, never both at
// once: the engine alternates two samplers).
#ifndef TANDEM_ENGINE_RUNTIME_DEVICE_SAMPLER_H_
#define TANDEM_ENGINE_RUNTIME_DEVICE_SAMPLER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "kernels/backend.h"
#include "kernels/device.h"

namespace tandem::engine {

class DeviceSampler {
 public:
  // One logits row: what engine::SampleRequest holds, less the logits (on the
  // device).
  struct Row {
    const SamplingParams* params = nullptr;  // not owned
    const PenaltyState* history = nullptr;   // not owned; null = empty history
    absl::Span<const int32_t> suppressed_tokens;
    // Structured output: SampleRequest::allowed_bitmask (at least vocab bits);
    // empty: no mask. Must stay valid until Prepare returns.
    absl::Span<const uint32_t> allowed_bitmask;
    int64_t position = 0;  // output position of the token (the RNG counter)
    // Prompt scoring (engine::ScoreToken on the device): >= 0 scores this
    // token instead of sampling; the result's logprob, rank and score_top
    // alternatives (<= kMaxTopLogprobs) are of the raw logits. `params`,
    // `history`, `suppressed_tokens`, `allowed_bitmask` are ignored.
    int32_t score_token = -1;
    int32_t score_top = 0;
  };

  // `backend` (not owned) must sample on its device (SupportsSampling()).
  DeviceSampler(kernels::Backend* backend, int64_t vocab_size);

  // Packs and uploads the rows' inputs (Pack, then Upload). An error (bad
  // parameters, device memory) leaves the logits untouched: the caller can
  // still sample them on the host.
  absl::Status Prepare(absl::Span<const Row> rows);
  // The two halves of Prepare, for the overlapped step (engine.h,
  // EngineOptions::overlap_steps): Pack reads the rows and fills the host
  // staging buffer only (no device call: it may run while another thread drives
  // the device); nothing of `rows` is kept after it returns. Upload reserves the
  // device buffers and copies the staging buffer up, on the thread that then
  // calls Run.
  absl::Status Pack(absl::Span<const Row> rows);
  absl::Status Upload();
  // Samples the prepared rows from `logits` ([rows, vocab] fp32 device memory,
  // modified in place: bias, penalties and suppression) and fills one result per row
  // (a row's own error in its entry). The returned status is the call's: a
  // device or kernel error.
  absl::Status Run(float* logits, std::vector<absl::StatusOr<SampleResult>>* results);

  // Device memory held (staging inputs and outputs).
  int64_t device_bytes() const {
    return static_cast<int64_t>(in_.bytes() + out_.bytes());
  }

 private:
  // Grows *buf to at least `bytes` (doubling), on the backend's device.
  absl::Status Reserve(kernels::DeviceBuffer* buf, size_t bytes);

  kernels::Backend* backend_;  // not owned
  int64_t vocab_;
  kernels::DeviceBuffer in_, out_;
  std::vector<unsigned char> staging_;  // host side of in_ (valid until Run syncs)
  std::vector<unsigned char> results_;  // host side of out_
  // Prepare's packing scratch, reused.
  std::vector<int32_t> pen_offsets_, sup_offsets_, pen_tokens_, pen_counts_,
      sup_tokens_, bias_offsets_, bias_tokens_;
  std::vector<float> bias_values_;
  std::vector<uint8_t> pen_in_prompt_;
  // The prepared step: each row's logprob request (Run's results), the
  // staging layout.
  struct RowOut {
    bool logprobs = false;
    int32_t top_logprobs = 0;
    bool scored = false;
  };
  std::vector<RowOut> rows_;
  bool packed_ = false;  // Pack succeeded, Upload not called yet
  bool ready_ = false;   // Upload succeeded, Run not called yet
  size_t in_bytes_ = 0;
  size_t o_params_ = 0, o_pen_off_ = 0, o_pen_tok_ = 0, o_pen_cnt_ = 0, o_pen_flag_ = 0,
         o_sup_off_ = 0, o_sup_tok_ = 0, o_masks_ = 0, o_bias_off_ = 0, o_bias_tok_ = 0,
         o_bias_val_ = 0;
  int32_t masks_ = 0, top_n_ = 0;
  bool penalties_ = false, suppress_ = false, bias_ = false;
  kernels::SampleArgs args_;
  size_t out_bytes_ = 0;
  size_t off_tokens_ = 0, off_status_ = 0, off_logprobs_ = 0, off_top_ids_ = 0,
         off_top_lps_ = 0, off_ranks_ = 0;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_DEVICE_SAMPLER_H_
