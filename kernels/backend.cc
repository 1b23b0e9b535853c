#include "kernels/backend.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::kernels {

absl::string_view OpName(Op op) {
  switch (op) {
    case Op::kGemmBf16:
      return "GemmBf16";
    case Op::kGemmF32:
      return "GemmF32";
    case Op::kRmsNorm:
      return "RmsNorm";
    case Op::kL2NormHeads:
      return "L2NormHeads";
    case Op::kSituGlu:
      return "SituGlu";
    case Op::kMulSigmoid:
      return "MulSigmoid";
    case Op::kAddInPlace:
      return "AddInPlace";
    case Op::kEmbeddingGather:
      return "EmbeddingGather";
    case Op::kCausalConv1dSilu:
      return "CausalConv1dSilu";
    case Op::kKdaGates:
      return "KdaGates";
    case Op::kKdaRecurrent:
      return "KdaRecurrent";
    case Op::kKdaChunked:
      return "KdaChunked";
    case Op::kKdaOutputGate:
      return "KdaOutputGate";
    case Op::kPagedCacheWrite:
      return "PagedCacheWrite";
    case Op::kMlaAttentionExpanded:
      return "MlaAttentionExpanded";
    case Op::kMlaAttentionAbsorbed:
      return "MlaAttentionAbsorbed";
    case Op::kRouterTopK:
      return "RouterTopK";
    case Op::kMoeMxfp4:
      return "MoeMxfp4";
    case Op::kAttnResMix:
      return "AttnResMix";
    case Op::kChunkHashes:
      return "ChunkHashes";
    case Op::kRope2d:
      return "Rope2d";
    case Op::kGelu:
      return "Gelu";
    case Op::kVisionAttention:
      return "VisionAttention";
    case Op::kMerge2x2:
      return "Merge2x2";
  }
  return "unknown op";
}

bool IsVisionOp(Op op) {
  return op == Op::kRope2d || op == Op::kGelu || op == Op::kVisionAttention ||
         op == Op::kMerge2x2;
}

namespace {

// The slot table of a batched op, read on the host (the defaults below).
absl::Status ReadSlots(Device& device, const int32_t* slots, int64_t num_seqs,
                       const char* op, std::vector<int32_t>* out) {
  if (num_seqs < 0)
    return absl::InvalidArgumentError(absl::StrCat(op, ": num_seqs < 0"));
  if (num_seqs > 0 && slots == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": slots is null"));
  }
  if (!device.host_addressable()) {
    return absl::UnimplementedError(absl::StrCat(
        op, ": not implemented for device ", device.name(), " (host reads of slots)"));
  }
  out->assign(slots, slots + num_seqs);
  return absl::OkStatus();
}

// Zeros `rows` rows of `width` floats at `y` (row stride ld).
absl::Status ZeroRows(Device& device, float* y, int64_t ld, int64_t rows,
                      int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    absl::Status s = device.Memset(y + r * ld, 0, static_cast<size_t>(width) * 4);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status NotImplemented(Backend& be, Op op) {
  return absl::UnimplementedError(
      absl::StrCat(OpName(op), " is not implemented by the ", be.name(),
                   " backend (the vision tower needs it; the CPU backends have it)"));
}

}  // namespace

absl::Status Backend::Rope2d(float*, int64_t, const int32_t*, int64_t, int64_t, int64_t,
                             float) {
  return NotImplemented(*this, Op::kRope2d);
}
absl::Status Backend::Gelu(const float*, int64_t, float*, int64_t, int64_t, int64_t,
                           bool) {
  return NotImplemented(*this, Op::kGelu);
}
absl::Status Backend::VisionAttention(const VisionAttnArgs&) {
  return NotImplemented(*this, Op::kVisionAttention);
}
absl::Status Backend::Merge2x2(const float*, int64_t, int64_t, int64_t, int64_t, float*,
                               int64_t) {
  return NotImplemented(*this, Op::kMerge2x2);
}

absl::Status Backend::SampleTokens(const SampleArgs&) {
  return absl::UnimplementedError(
      absl::StrCat("token sampling on the device is not implemented by the ", name(),
                   " backend (host backends sample with engine::Sampler)"));
}

absl::Status Backend::CausalConv1dSiluSlots(const float* x, int64_t ldx, const float* w,
                                            int64_t kernel, float* state_base,
                                            int64_t state_stride, const int32_t* slots,
                                            int64_t num_seqs, float* y, int64_t ldy,
                                            int64_t tokens_per_seq, int64_t channels) {
  std::vector<int32_t> s;
  absl::Status st = ReadSlots(device(), slots, num_seqs, "CausalConv1dSiluSlots", &s);
  if (!st.ok()) return st;
  const int64_t T = tokens_per_seq;
  for (int64_t i = 0; i < num_seqs; ++i) {
    st = s[i] < 0 ? ZeroRows(device(), y + i * T * ldy, ldy, T, channels)
                  : CausalConv1dSilu(x + i * T * ldx, ldx, w, kernel,
                                     state_base + s[i] * state_stride, y + i * T * ldy,
                                     ldy, T, channels);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status Backend::KdaRecurrentSlots(const KdaArgs& args, int64_t num_seqs,
                                        const int32_t* slots, int64_t state_stride) {
  std::vector<int32_t> s;
  absl::Status st = ReadSlots(device(), slots, num_seqs, "KdaRecurrentSlots", &s);
  if (!st.ok()) return st;
  const int64_t T = args.tokens, h = args.heads;
  for (int64_t i = 0; i < num_seqs; ++i) {
    KdaArgs a = args;
    a.q += i * T * args.ld_qk;
    a.k += i * T * args.ld_qk;
    a.v += i * T * args.ld_v;
    a.g += i * T * h * args.head_dim_k;
    a.beta += i * T * h;
    a.out += i * T * args.ld_out;
    if (s[i] < 0) {
      st = ZeroRows(device(), a.out, args.ld_out, T, h * args.head_dim_v);
    } else {
      a.state = args.state + s[i] * state_stride;
      st = KdaRecurrent(a);
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels
