// GpuBackend: the mla ops (kernels in mla.cu; design and error bound in mla.h).
#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/mla.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {
namespace {

// The SM count the split heuristic assumes (H100/H200: 132; B200: 148).
constexpr int kAssumedSms = 132;
// Bound on the expanded form's per-call scratch (keys/values of one context chunk).
constexpr size_t kExpandedScratchBudget = size_t{256} << 20;

absl::Status Prepare(const MlaArgs& m, int32_t* error_word, bool absorbed,
                     MlaLaunchArgs* a) {
  // Shapes only: query_start, seq_lens and block tables are device memory, checked
  // in the kernels (error word).
  TANDEM_RETURN_IF_ERROR(CheckMlaShape(m));
  if (m.num_seqs > 0 && m.num_tokens <= 0) {
    return InvalidArgument(
        "mla: num_tokens (the host copy of query_start[num_seqs]) must be set for a "
        "device backend, got ",
        m.num_tokens);
  }
  if (m.num_seqs * m.heads > 65535) {
    return InvalidArgument("mla: ", m.num_seqs, " sequences x ", m.heads,
                           " heads exceed the launch grid");
  }
  a->heads = m.heads;
  a->nope = m.nope_dim;
  a->rope = m.rope_dim;
  a->v = m.v_dim;
  a->lora = m.kv_lora_rank;
  a->scale = m.scale;
  a->num_seqs = m.num_seqs;
  a->num_tokens = m.num_tokens;
  a->seq_lens = m.seq_lens;
  a->query_start = m.query_start;
  a->block_tables = m.block_tables;
  a->block_table_stride = m.block_table_stride;
  a->kv_cache = m.kv_cache;
  a->num_blocks = m.num_blocks;
  a->block_size = m.block_size;
  a->kv_b_proj = m.kv_b_proj;
  a->q = m.q;
  a->ld_q = m.ld_q;
  a->out = m.out;
  a->ld_out = m.ld_out;
  a->error_word = error_word;
  a->max_context = m.max_context;
  if (const char* why = MlaUnsupported(*a, absorbed))
    return absl::UnimplementedError(why);
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuBackend::MlaAttentionExpanded(const MlaArgs& args) {
  MlaLaunchArgs a;
  TANDEM_RETURN_IF_ERROR(Prepare(args, error_word(), /*absorbed=*/false, &a));
  if (a.num_seqs == 0) return absl::OkStatus();
  const int64_t chunk = MlaExpandedChunk(a, kExpandedScratchBudget);
  TANDEM_ASSIGN_OR_RETURN(void* scratch, Scratch(MlaExpandedScratchBytes(a, chunk)));
  if (const char* err =
          MlaExpandedLaunch(a, chunk, scratch, stream(), MlaCore::kAuto,
                            /*bf16_operands=*/precision() == GpuPrecision::kBf16)) {
    return absl::InternalError(absl::StrCat("MlaAttentionExpanded: ", err));
  }
  return Launched("MlaAttentionExpanded");
}

absl::Status GpuBackend::MlaAttentionAbsorbed(const MlaArgs& args) {
  MlaLaunchArgs a;
  TANDEM_RETURN_IF_ERROR(Prepare(args, error_word(), /*absorbed=*/true, &a));
  if (a.num_seqs == 0) return absl::OkStatus();
  // The decomposition is planned for the caller's batch and context if it names
  // them (MlaArgs::split_seqs / split_context), else for this call.
  MlaLaunchArgs plan = a;
  if (args.split_seqs > 0) {
    plan.num_tokens = a.num_tokens / a.num_seqs * args.split_seqs;
    plan.num_seqs = args.split_seqs;
  }
  if (args.split_context > 0 && a.block_size > 0) {
    plan.block_table_stride = (args.split_context + a.block_size - 1) / a.block_size;
  }
  const int splits = MlaAbsorbedSplits(plan, kAssumedSms);
  TANDEM_ASSIGN_OR_RETURN(void* scratch, Scratch(MlaAbsorbedScratchBytes(a, splits)));
  if (const char* err =
          MlaAbsorbedLaunch(a, splits, scratch, stream(), MlaCore::kAuto,
                            /*bf16_operands=*/precision() == GpuPrecision::kBf16)) {
    return absl::InternalError(absl::StrCat("MlaAttentionAbsorbed: ", err));
  }
  return Launched("MlaAttentionAbsorbed");
}

}  // namespace tandem::kernels::cuda
