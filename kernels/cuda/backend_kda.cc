// GpuBackend: the KDA recurrences (kernels in kda.cu; design and error bounds in
// kda.h).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kda.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {
namespace {

// Scratch for one KdaChunked launch (the per-chunk operand records): K3 at TP8
// (12 heads, d = 128) fits 2608 tokens a launch.
constexpr size_t kScratchBudget = size_t{64} << 20;

// Elements spanned by `rows` rows of `width` with stride ld.
size_t Span(int64_t rows, int64_t width, int64_t ld) {
  return rows <= 0 ? 0 : static_cast<size_t>((rows - 1) * ld + width);
}

KdaLaunchArgs ToLaunch(const KdaArgs& a) {
  KdaLaunchArgs l;
  l.tokens = a.tokens;
  l.heads = a.heads;
  l.head_dim_k = a.head_dim_k;
  l.head_dim_v = a.head_dim_v;
  l.q = a.q;
  l.k = a.k;
  l.ld_qk = a.ld_qk;
  l.v = a.v;
  l.ld_v = a.ld_v;
  l.g = a.g;
  l.beta = a.beta;
  l.state = a.state;
  l.out = a.out;
  l.ld_out = a.ld_out;
  return l;
}

// Shapes (CheckKda, the CPU backends' messages), the kernels' own limits, and
// that every range is memory of this device. OK with *run = false: nothing to do.
absl::Status PrepareKda(const GpuBackend& be, const KdaArgs& a, bool* run) {
  *run = false;
  TANDEM_RETURN_IF_ERROR(CheckKda(a));
  if (a.tokens == 0) return absl::OkStatus();
  if (a.head_dim_k > kKdaMaxHeadDimK) {
    return absl::UnimplementedError(absl::StrCat("kda: head_dim_k ", a.head_dim_k,
                                                 " above the GPU kernels' limit of ",
                                                 kKdaMaxHeadDimK));
  }
  if (a.heads > 65535) {
    return InvalidArgument("kda: ", a.heads, " heads exceed the launch grid");
  }
  const int64_t dk = a.head_dim_k, dv = a.head_dim_v, h = a.heads, t = a.tokens;
  TANDEM_RETURN_IF_ERROR(
      be.CheckResident(a.state, static_cast<size_t>(h * dk * dv) * 4, "kda state"));
  TANDEM_RETURN_IF_ERROR(be.CheckResident(a.q, Span(t, h * dk, a.ld_qk) * 4, "kda q"));
  TANDEM_RETURN_IF_ERROR(be.CheckResident(a.k, Span(t, h * dk, a.ld_qk) * 4, "kda k"));
  TANDEM_RETURN_IF_ERROR(be.CheckResident(a.v, Span(t, h * dv, a.ld_v) * 4, "kda v"));
  TANDEM_RETURN_IF_ERROR(
      be.CheckResident(a.g, static_cast<size_t>(t * h * dk) * 4, "kda g"));
  TANDEM_RETURN_IF_ERROR(
      be.CheckResident(a.beta, static_cast<size_t>(t * h) * 4, "kda beta"));
  TANDEM_RETURN_IF_ERROR(
      be.CheckResident(a.out, Span(t, h * dv, a.ld_out) * 4, "kda out"));
  *run = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuBackend::KdaRecurrent(const KdaArgs& args) {
  bool run = false;
  TANDEM_RETURN_IF_ERROR(PrepareKda(*this, args, &run));
  if (!run) return absl::OkStatus();
  if (const char* e = KdaRecurrentLaunch(ToLaunch(args), stream())) {
    return Internal(name(), ": launching KdaRecurrent failed: ", e);
  }
  return Launched("KdaRecurrent");
}

absl::Status GpuBackend::KdaRecurrentSlots(const KdaArgs& args, int64_t num_seqs,
                                           const int32_t* slots, int64_t state_stride) {
  if (num_seqs < 0 || state_stride < 0) {
    return InvalidArgument("kda: num_seqs and state_stride must be >= 0");
  }
  if (num_seqs > 65535) return InvalidArgument("kda: more than 65535 sequences");
  if (num_seqs == 0 || args.tokens == 0) return absl::OkStatus();
  if (slots == nullptr) return InvalidArgument("kda: slots is null");
  // The shapes and ranges of all rows (the first sequence's state: the others'
  // are picked on the device).
  KdaArgs all = args;
  all.tokens = args.tokens * num_seqs;
  bool run = false;
  TANDEM_RETURN_IF_ERROR(PrepareKda(*this, all, &run));
  if (!run) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      CheckResident(slots, static_cast<size_t>(num_seqs) * 4, "kda slots"));
  KdaLaunchArgs l = ToLaunch(args);
  l.num_seqs = num_seqs;
  l.state_slots = slots;
  l.state_stride = state_stride;
  if (const char* e = KdaRecurrentLaunch(l, stream())) {
    return Internal(name(), ": launching KdaRecurrent failed: ", e);
  }
  return Launched("KdaRecurrent");
}

absl::Status GpuBackend::KdaChunked(const KdaArgs& args) {
  bool run = false;
  TANDEM_RETURN_IF_ERROR(PrepareKda(*this, args, &run));
  if (!run) return absl::OkStatus();
  // Long prompts run in segments whose chunk records fit the scratch budget; the
  // state carries from one segment to the next (the kernels update it in place),
  // so the result is that of one call.
  const int64_t seg =
      KdaChunkedTokensFor(kScratchBudget, args.heads, args.head_dim_k, args.head_dim_v);
  const int64_t first = std::min(seg, args.tokens);
  TANDEM_ASSIGN_OR_RETURN(
      void* scratch, Scratch(KdaChunkedScratchBytes(first, args.heads, args.head_dim_k,
                                                    args.head_dim_v)));
  for (int64_t t0 = 0; t0 < args.tokens; t0 += seg) {
    KdaLaunchArgs l = ToLaunch(args);
    l.tokens = std::min(seg, args.tokens - t0);
    l.q += t0 * args.ld_qk;
    l.k += t0 * args.ld_qk;
    l.v += t0 * args.ld_v;
    l.g += t0 * args.heads * args.head_dim_k;
    l.beta += t0 * args.heads;
    l.out += t0 * args.ld_out;
    if (const char* e = KdaChunkedLaunch(l, scratch, stream())) {
      return Internal(name(), ": launching KdaChunked failed: ", e);
    }
  }
  return Launched("KdaChunked");
}

}  // namespace tandem::kernels::cuda
