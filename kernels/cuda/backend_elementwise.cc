// GpuBackend: the elementwise ops (kernels in elementwise.cu). Each method checks
// shapes as the CPU backends do (kernels/op_checks.h, the same messages), treats an
// empty problem as a no-op, then enqueues the launch on the compute stream. Index
// arrays (token ids, slots) are device memory: the kernels check them and record
// errors in error_word() for the next Synchronize().
#include <cstddef>
#include <initializer_list>

#include "common/status.h"
#include "kernels/cuda/backend_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {
namespace {

using backend_util::Done;
using backend_util::kF;
using backend_util::Range;
using backend_util::Resident;
using backend_util::Span;

}  // namespace

absl::Status GpuBackend::RmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                                 int64_t ldy, int64_t rows, int64_t n, float eps) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "rmsnorm"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "rmsnorm"));
  if (rows == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(*this, {{x, Span(rows, n, ldx) * kF, "rmsnorm x"},
                                          {w, n * kF, "rmsnorm w"},
                                          {y, Span(rows, n, ldy) * kF, "rmsnorm y"}}));
  return Done(this, LaunchRmsNorm(x, ldx, w, y, ldy, rows, n, eps, stream()),
              "rmsnorm");
}

absl::Status GpuBackend::L2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                                     int64_t rows, int64_t heads, int64_t d, float eps,
                                     float scale) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldx, "l2norm"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, heads * d, ldy, "l2norm"));
  if (rows == 0 || heads <= 0 || d <= 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{x, Span(rows, heads * d, ldx) * kF, "l2norm x"},
                       {y, Span(rows, heads * d, ldy) * kF, "l2norm y"}}));
  return Done(this,
              LaunchL2NormHeads(x, ldx, y, ldy, rows, heads, d, eps, scale, stream()),
              "l2norm");
}

absl::Status GpuBackend::SituGlu(const float* g, int64_t ldg, const float* u,
                                 int64_t ldu, float* out, int64_t ldo, int64_t rows,
                                 int64_t n, float beta, float lbeta) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "situ"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldu, "situ"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "situ"));
  if (rows == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(*this, {{g, Span(rows, n, ldg) * kF, "situ g"},
                                          {u, Span(rows, n, ldu) * kF, "situ u"},
                                          {out, Span(rows, n, ldo) * kF, "situ out"}}));
  return Done(this,
              LaunchSituGlu(g, ldg, u, ldu, out, ldo, rows, n, beta, lbeta, stream()),
              "situ");
}

absl::Status GpuBackend::MulSigmoid(const float* x, int64_t ldx, const float* gate,
                                    int64_t ldg, float* out, int64_t ldo, int64_t rows,
                                    int64_t n) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "mul_sigmoid"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldg, "mul_sigmoid"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldo, "mul_sigmoid"));
  if (rows == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{x, Span(rows, n, ldx) * kF, "mul_sigmoid x"},
                       {gate, Span(rows, n, ldg) * kF, "mul_sigmoid gate"},
                       {out, Span(rows, n, ldo) * kF, "mul_sigmoid out"}}));
  return Done(this, LaunchMulSigmoid(x, ldx, gate, ldg, out, ldo, rows, n, stream()),
              "mul_sigmoid");
}

absl::Status GpuBackend::AddInPlace(float* y, const float* x, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{y, n * kF, "add_in_place y"}, {x, n * kF, "add_in_place x"}}));
  return Done(this, LaunchAddInPlace(y, x, n, stream()), "add_in_place");
}

absl::Status GpuBackend::EmbeddingGatherRows(const uint16_t* table, int64_t vocab,
                                             int64_t first, int64_t rows,
                                             int64_t hidden, const int32_t* ids,
                                             int64_t tokens, float* out) {
  TANDEM_RETURN_IF_ERROR(CheckEmbeddingRows(vocab, first, rows));
  if (tokens <= 0 || hidden <= 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{table, Span(rows, hidden, hidden) * sizeof(uint16_t), "embedding table"},
              {ids, tokens * sizeof(int32_t), "embedding ids"},
              {out, Span(tokens, hidden, hidden) * kF, "embedding out"}}));
  return Done(this,
              LaunchEmbeddingGather(table, vocab, first, rows, hidden, ids, tokens, out,
                                    error_word(), stream()),
              "embedding");
}

absl::Status GpuBackend::CausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                          int64_t kernel, float* state, float* y,
                                          int64_t ldy, int64_t tokens,
                                          int64_t channels) {
  if (kernel < 1) return InvalidArgument("conv1d: kernel must be >= 1");
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldx, "conv1d"));
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, channels, ldy, "conv1d"));
  if (tokens == 0 || channels == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{x, Span(tokens, channels, ldx) * kF, "conv1d x"},
              {w, Span(channels, kernel, kernel) * kF, "conv1d w"},
              {state, Span(kernel - 1, channels, channels) * kF, "conv1d state"},
              {y, Span(tokens, channels, ldy) * kF, "conv1d y"}}));
  return Done(this,
              LaunchCausalConv1dSilu(x, ldx, w, kernel, state, y, ldy, tokens, channels,
                                     stream()),
              "conv1d");
}

absl::Status GpuBackend::CausalConv1dSiluSlots(
    const float* x, int64_t ldx, const float* w, int64_t kernel, float* state_base,
    int64_t state_stride, const int32_t* slots, int64_t num_seqs, float* y, int64_t ldy,
    int64_t tokens_per_seq, int64_t channels) {
  if (kernel < 1) return InvalidArgument("conv1d: kernel must be >= 1");
  if (num_seqs < 0 || state_stride < 0) {
    return InvalidArgument("conv1d: num_seqs and state_stride must be >= 0");
  }
  const int64_t rows = num_seqs * tokens_per_seq;
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, channels, ldx, "conv1d"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, channels, ldy, "conv1d"));
  if (rows == 0 || channels == 0) return absl::OkStatus();
  // The slots are device memory: only the pool's first state is checkable here.
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{x, Span(rows, channels, ldx) * kF, "conv1d x"},
              {w, Span(channels, kernel, kernel) * kF, "conv1d w"},
              {slots, num_seqs * sizeof(int32_t), "conv1d slots"},
              {state_base, Span(kernel - 1, channels, channels) * kF, "conv1d state"},
              {y, Span(rows, channels, ldy) * kF, "conv1d y"}}));
  return Done(
      this,
      LaunchCausalConv1dSiluSlots(x, ldx, w, kernel, state_base, state_stride, slots,
                                  num_seqs, y, ldy, tokens_per_seq, channels, stream()),
      "conv1d");
}

absl::Status GpuBackend::KdaGates(const float* graw, int64_t ld_graw,
                                  const float* a_log, const float* dt_bias,
                                  const float* braw, int64_t ld_braw, float lower_bound,
                                  int64_t tokens, int64_t heads, int64_t d, float* g,
                                  float* beta) {
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_graw, "kda_gates"));
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads, ld_braw, "kda_gates"));
  if (tokens == 0 || heads <= 0 || d <= 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{graw, Span(tokens, heads * d, ld_graw) * kF, "kda_gates graw"},
                       {a_log, heads * kF, "kda_gates a_log"},
                       {dt_bias, heads * d * kF, "kda_gates dt_bias"},
                       {braw, Span(tokens, heads, ld_braw) * kF, "kda_gates braw"},
                       {g, tokens * heads * d * kF, "kda_gates g"},
                       {beta, tokens * heads * kF, "kda_gates beta"}}));
  return Done(this,
              LaunchKdaGates(graw, ld_graw, a_log, dt_bias, braw, ld_braw, lower_bound,
                             tokens, heads, d, g, beta, stream()),
              "kda_gates");
}

absl::Status GpuBackend::KdaOutputGate(const float* o, int64_t ld_o,
                                       const float* norm_w, const float* gate,
                                       int64_t ld_gate, float* out, int64_t ld_out,
                                       int64_t tokens, int64_t heads, int64_t d,
                                       float eps) {
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_o, "kda_output_gate"));
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_gate, "kda_output_gate"));
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, heads * d, ld_out, "kda_output_gate"));
  if (tokens == 0 || heads <= 0 || d <= 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{o, Span(tokens, heads * d, ld_o) * kF, "kda_output_gate o"},
              {norm_w, d * kF, "kda_output_gate norm_w"},
              {gate, Span(tokens, heads * d, ld_gate) * kF, "kda_output_gate gate"},
              {out, Span(tokens, heads * d, ld_out) * kF, "kda_output_gate out"}}));
  return Done(this,
              LaunchKdaOutputGate(o, ld_o, norm_w, gate, ld_gate, out, ld_out, tokens,
                                  heads, d, eps, stream()),
              "kda_output_gate");
}

absl::Status GpuBackend::PagedCacheWrite(const float* src, int64_t ld_src,
                                         const int32_t* slots, int64_t tokens,
                                         int64_t width, uint16_t* cache,
                                         int64_t num_slots) {
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, width, ld_src, "cache_write"));
  if (tokens == 0 || width == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{src, Span(tokens, width, ld_src) * kF, "cache_write src"},
                       {slots, tokens * sizeof(int32_t), "cache_write slots"},
                       {cache, Span(num_slots, width, width) * sizeof(uint16_t),
                        "cache_write cache"}}));
  return Done(this,
              LaunchPagedCacheWrite(src, ld_src, slots, tokens, width, cache, num_slots,
                                    error_word(), stream()),
              "cache_write");
}

absl::Status GpuBackend::AttnResMix(const float* const* bank, int64_t bank_size,
                                    const float* p, const float* proj_w,
                                    const float* norm_w, float eps, int64_t tokens,
                                    int64_t hidden, float* out) {
  if (bank_size < 0 || tokens < 0 || hidden <= 0) {
    return InvalidArgument("attn_res_mix: bad shape");
  }
  if (tokens == 0) return absl::OkStatus();
  if (bank_size + 1 > 65535) {
    return InvalidArgument("attn_res_mix: ", bank_size,
                           " bank entries exceed the launch grid");
  }
  TANDEM_RETURN_IF_ERROR(
      Resident(*this, {{bank, bank_size * sizeof(const float*), "attn_res_mix bank"},
                       {p, tokens * hidden * kF, "attn_res_mix p"},
                       {proj_w, hidden * kF, "attn_res_mix proj_w"},
                       {norm_w, hidden * kF, "attn_res_mix norm_w"},
                       {out, tokens * hidden * kF, "attn_res_mix out"}}));
  TANDEM_ASSIGN_OR_RETURN(void* scratch,
                          Scratch(AttnResMixScratchBytes(tokens, bank_size)));
  return Done(this,
              LaunchAttnResMix(bank, bank_size, p, proj_w, norm_w, eps, tokens, hidden,
                               out, static_cast<float*>(scratch), stream()),
              "attn_res_mix");
}

}  // namespace tandem::kernels::cuda
