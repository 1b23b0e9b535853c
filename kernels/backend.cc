#include "kernels/backend.h"

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
  }
  return "unknown op";
}

}  // namespace tandem::kernels
