// GpuBackend: the moe ops (kernels in moe.cu; design and error bound in moe.h).
#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/backend_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/moe.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {

// The kernels read MoeArgs::experts (a device array) as MoeExpertPtrs.
static_assert(sizeof(MoeExpertPtrs) == sizeof(Mxfp4Expert));
static_assert(offsetof(MoeExpertPtrs, w1_packed) == offsetof(Mxfp4Expert, w1_packed));
static_assert(offsetof(MoeExpertPtrs, w1_scale) == offsetof(Mxfp4Expert, w1_scale));
static_assert(offsetof(MoeExpertPtrs, w3_packed) == offsetof(Mxfp4Expert, w3_packed));
static_assert(offsetof(MoeExpertPtrs, w3_scale) == offsetof(Mxfp4Expert, w3_scale));
static_assert(offsetof(MoeExpertPtrs, w2_packed) == offsetof(Mxfp4Expert, w2_packed));
static_assert(offsetof(MoeExpertPtrs, w2_scale) == offsetof(Mxfp4Expert, w2_scale));

namespace {

using backend_util::Range;
using backend_util::Resident;  // the expert weights behind MoeArgs::experts are
                               // device pointers in device memory: not checked
using backend_util::Span;

}  // namespace

absl::Status GpuBackend::RouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                                    const float* bias, int64_t tokens, int64_t hidden,
                                    int64_t num_experts, int64_t top_k,
                                    bool renormalize, float scaling, int32_t* ids,
                                    float* weights) {
  TANDEM_RETURN_IF_ERROR(CheckRows(tokens, hidden, ldx, "router"));
  if (top_k < 0 || top_k > num_experts) {
    return InvalidArgument("router: top_k ", top_k, " not in [0, ", num_experts, "]");
  }
  if (tokens == 0 || top_k == 0) return absl::OkStatus();
  if (!x || !gate || !bias || !ids || !weights) {
    return InvalidArgument("router: null pointer");
  }
  if (tokens > 65535 * 8 || num_experts > 65535 * 8) {
    return InvalidArgument("router: ", tokens, " tokens x ", num_experts,
                           " experts exceed the launch grid");
  }
  const size_t tk = static_cast<size_t>(tokens * top_k);
  TANDEM_RETURN_IF_ERROR(Resident(
      *this,
      {{x, Span(tokens, hidden, ldx) * sizeof(float), "router x"},
       {gate, Span(num_experts, hidden, hidden) * sizeof(uint16_t), "router gate"},
       {bias, static_cast<size_t>(num_experts) * sizeof(float), "router bias"},
       {ids, tk * sizeof(int32_t), "router ids"},
       {weights, tk * sizeof(float), "router weights"}}));
  TANDEM_ASSIGN_OR_RETURN(void* scratch,
                          Scratch(RouterScratchBytes(tokens, num_experts)));
  if (const char* err =
          LaunchRouterTopK(x, ldx, gate, bias, tokens, hidden, num_experts, top_k,
                           renormalize, scaling, ids, weights, scratch, stream())) {
    return absl::InternalError(absl::StrCat("RouterTopK: ", err));
  }
  return absl::OkStatus();
}

absl::Status GpuBackend::MoeMxfp4(const MoeArgs& args) {
  // Shapes only: the ids are device memory, checked in the kernel (error word).
  TANDEM_RETURN_IF_ERROR(CheckMoeShape(args));
  if (args.tokens == 0) return absl::OkStatus();
  const size_t tk = static_cast<size_t>(args.tokens * args.top_k);
  TANDEM_RETURN_IF_ERROR(Resident(
      *this,
      {{args.z, Span(args.tokens, args.hidden, args.ld_z) * sizeof(float), "moe z"},
       {args.out, Span(args.tokens, args.hidden, args.ld_out) * sizeof(float),
        "moe out"},
       {args.ids, tk * sizeof(int32_t), "moe ids"},
       {args.weights, tk * sizeof(float), "moe weights"},
       {args.experts,
        args.top_k > 0 ? static_cast<size_t>(args.num_experts) * sizeof(Mxfp4Expert)
                       : 0,
        "moe experts"}}));
  const int64_t chunk = std::min(args.tokens, kMoeChunkTokens);
  // Exact backends feed the tensor cores split-BF16 activations (moe.h).
  const bool split = precision() == GpuPrecision::kExact;
  TANDEM_ASSIGN_OR_RETURN(
      void* scratch, Scratch(MoeScratchBytes(chunk, args.hidden, args.inter, args.top_k,
                                             args.num_experts, split)));
  for (int64_t t0 = 0; t0 < args.tokens; t0 += chunk) {
    MoeLaunchArgs a;
    a.tokens = std::min(chunk, args.tokens - t0);
    a.hidden = args.hidden;
    a.inter = args.inter;
    a.top_k = args.top_k;
    a.num_experts = args.num_experts;
    a.experts = reinterpret_cast<const MoeExpertPtrs*>(args.experts);
    a.z = args.z + t0 * args.ld_z;
    a.ld_z = args.ld_z;
    a.ids = args.ids == nullptr ? nullptr : args.ids + t0 * args.top_k;
    a.weights = args.weights == nullptr ? nullptr : args.weights + t0 * args.top_k;
    a.situ_beta = args.situ_beta;
    a.situ_linear_beta = args.situ_linear_beta;
    a.out = args.out + t0 * args.ld_out;
    a.ld_out = args.ld_out;
    a.split_bf16 = split;
    if (const char* err = LaunchMoeMxfp4(a, scratch, error_word(), stream())) {
      return absl::InternalError(absl::StrCat("MoeMxfp4: ", err));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
