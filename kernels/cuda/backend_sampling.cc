// GpuBackend: SampleTokens (kernels in sampling.cu). The logits, parameters,
// penalty and suppression tables and the outputs are device memory; shapes are
// checked here, ids out of the vocabulary are skipped by the kernel and
// recorded in error_word() for Synchronize().
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/sampling.h"

namespace tandem::kernels::cuda {

absl::Status GpuBackend::SampleTokens(const SampleArgs& args) {
  if (args.rows < 0 || args.vocab <= 0 || args.vocab > kSamplingMaxVocab) {
    return InvalidArgument(name(), ": sample tokens: ", args.rows,
                           " rows of vocabulary ", args.vocab, " (1 .. ",
                           kSamplingMaxVocab, " tokens)");
  }
  if (args.rows == 0) return absl::OkStatus();
  if (args.logits == nullptr || args.params == nullptr || args.token_ids == nullptr) {
    return InvalidArgument(name(),
                           ": sample tokens needs logits, params and token_ids");
  }
  if (args.top_n_stride < 0 || args.top_n_stride > kSamplingMaxTopLogprobs ||
      (args.top_n_stride > 0 &&
       (args.top_ids == nullptr || args.top_logprobs == nullptr))) {
    return InvalidArgument(name(), ": sample tokens: top_n_stride ", args.top_n_stride,
                           " (0 .. ", kSamplingMaxTopLogprobs,
                           ", with top_ids and top_logprobs when above 0)");
  }
  const size_t rows = static_cast<size_t>(args.rows);
  const size_t cells = rows * static_cast<size_t>(args.vocab);
  TANDEM_RETURN_IF_ERROR(
      CheckResident(args.logits, cells * sizeof(float), "sample logits"));
  TANDEM_RETURN_IF_ERROR(
      CheckResident(args.params, rows * sizeof(SamplingRowParams), "sample params"));
  TANDEM_RETURN_IF_ERROR(
      CheckResident(args.token_ids, rows * sizeof(int32_t), "sample token ids"));
  if (args.row_status != nullptr) {
    TANDEM_RETURN_IF_ERROR(
        CheckResident(args.row_status, rows * sizeof(int32_t), "sample row status"));
  }
  if (args.logprobs != nullptr) {
    TANDEM_RETURN_IF_ERROR(
        CheckResident(args.logprobs, rows * sizeof(float), "sample logprobs"));
  }
  if (args.top_n_stride > 0) {
    const size_t n = rows * static_cast<size_t>(args.top_n_stride);
    TANDEM_RETURN_IF_ERROR(CheckResident(args.top_ids, n * sizeof(int32_t), "top ids"));
    TANDEM_RETURN_IF_ERROR(
        CheckResident(args.top_logprobs, n * sizeof(float), "top logprobs"));
  }
  if (args.ranks != nullptr) {
    TANDEM_RETURN_IF_ERROR(
        CheckResident(args.ranks, rows * sizeof(int32_t), "sample ranks"));
  }
  if (args.probs != nullptr) {
    TANDEM_RETURN_IF_ERROR(CheckResident(args.probs, cells * sizeof(float), "probs"));
  }
  if (args.penalty_offsets != nullptr) {
    TANDEM_RETURN_IF_ERROR(CheckResident(
        args.penalty_offsets, (rows + 1) * sizeof(int32_t), "penalty offsets"));
  }
  if (args.allowed_bitmask != nullptr) {
    if (args.mask_count <= 0 ||
        static_cast<int64_t>(args.mask_words) * 32 < static_cast<int64_t>(args.vocab)) {
      return InvalidArgument(name(), ": sample tokens: ", args.mask_count, " masks of ",
                             args.mask_words, " words for a vocabulary of ",
                             args.vocab);
    }
    TANDEM_RETURN_IF_ERROR(CheckResident(
        args.allowed_bitmask,
        static_cast<size_t>(args.mask_count) * args.mask_words * sizeof(uint32_t),
        "allowed bitmask"));
  }
  if (args.suppress_offsets != nullptr) {
    TANDEM_RETURN_IF_ERROR(CheckResident(
        args.suppress_offsets, (rows + 1) * sizeof(int32_t), "suppress offsets"));
  }
  SampleArgs a = args;
  a.error_word = error_word();
  const char* e = LaunchSample(a, stream());
  if (e != nullptr) return Internal(name(), ": launching sampling failed: ", e);
  return Launched("sampling");
}

}  // namespace tandem::kernels::cuda
