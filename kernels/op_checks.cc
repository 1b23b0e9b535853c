#include "kernels/op_checks.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "common/status.h"

namespace tandem::kernels {

const float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float E8m0ToF32(uint8_t s) {
  if (s == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(s) - 127);
}

absl::Status CheckGemm(const void* x, int64_t ldx, const void* w, int64_t ldw,
                       const float* y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
  if (m < 0 || n < 0 || k < 0) return InvalidArgument("gemm: negative shape");
  if (m == 0 || n == 0) return absl::OkStatus();
  if (x == nullptr || w == nullptr || y == nullptr) {
    return InvalidArgument("gemm: null pointer");
  }
  if (ldx < k || ldw < k || ldy < n) {
    return InvalidArgument("gemm: leading dimension too small (ldx ", ldx, ", ldw ",
                           ldw, ", ldy ", ldy, ", n ", n, ", k ", k, ")");
  }
  return absl::OkStatus();
}

absl::Status CheckRows(int64_t rows, int64_t n, int64_t ld, const char* what) {
  if (rows < 0 || n < 0) return InvalidArgument(what, ": negative shape");
  if (rows > 1 && ld < n) return InvalidArgument(what, ": row stride ", ld, " < ", n);
  return absl::OkStatus();
}

absl::Status CheckKda(const KdaArgs& a) {
  if (a.tokens < 0 || a.heads <= 0 || a.head_dim_k <= 0 || a.head_dim_v <= 0) {
    return InvalidArgument("kda: bad shape");
  }
  if (a.state == nullptr) return InvalidArgument("kda: null state");
  if (a.tokens == 0) return absl::OkStatus();
  if (!a.q || !a.k || !a.v || !a.g || !a.beta || !a.out) {
    return InvalidArgument("kda: null pointer");
  }
  if (a.ld_qk < a.heads * a.head_dim_k || a.ld_v < a.heads * a.head_dim_v ||
      a.ld_out < a.heads * a.head_dim_v) {
    return InvalidArgument("kda: row stride too small");
  }
  return absl::OkStatus();
}

absl::Status CheckMlaShape(const MlaArgs& a) {
  if (a.heads <= 0 || a.nope_dim < 0 || a.rope_dim < 0 || a.v_dim <= 0 ||
      a.kv_lora_rank <= 0 || a.num_seqs < 0 || a.block_size <= 0 || a.num_blocks < 0) {
    return InvalidArgument("mla: bad shape");
  }
  if (a.num_seqs == 0) return absl::OkStatus();
  if (!a.seq_lens || !a.query_start || !a.block_tables || !a.kv_cache || !a.kv_b_proj ||
      !a.q || !a.out) {
    return InvalidArgument("mla: null pointer");
  }
  if (a.ld_q < a.heads * (a.nope_dim + a.rope_dim) || a.ld_out < a.heads * a.v_dim) {
    return InvalidArgument("mla: row stride too small");
  }
  return absl::OkStatus();
}

absl::Status CheckMla(const MlaArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckMlaShape(a));
  if (a.num_seqs == 0) return absl::OkStatus();
  if (a.query_start[0] != 0) return InvalidArgument("mla: query_start[0] != 0");
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.query_start[s + 1] - a.query_start[s];
    if (q_len < 0 || q_len > a.seq_lens[s]) {
      return InvalidArgument("mla: sequence ", s, " has ", q_len, " queries but ",
                             a.seq_lens[s], " tokens");
    }
    const int64_t blocks = (a.seq_lens[s] + a.block_size - 1) / a.block_size;
    if (blocks > a.block_table_stride) {
      return InvalidArgument("mla: sequence ", s, " needs ", blocks,
                             " blocks, table stride ", a.block_table_stride);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = a.block_tables[s * a.block_table_stride + b];
      if (id < 0 || id >= a.num_blocks) {
        return InvalidArgument("mla: sequence ", s, " block ", b, " id ", id,
                               " out of range [0, ", a.num_blocks, ")");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckMoeShape(const MoeArgs& a) {
  if (a.tokens < 0 || a.hidden <= 0 || a.inter <= 0 || a.top_k < 0 ||
      a.num_experts < 0) {
    return InvalidArgument("moe: bad shape");
  }
  if (a.hidden % 32 != 0 || a.inter % 32 != 0) {
    return InvalidArgument("moe: hidden ", a.hidden, " and inter ", a.inter,
                           " must be multiples of 32 (MXFP4 groups)");
  }
  if (a.tokens == 0) return absl::OkStatus();
  if (!a.z || !a.out || (a.top_k > 0 && (!a.ids || !a.weights || !a.experts))) {
    return InvalidArgument("moe: null pointer");
  }
  if (a.ld_z < a.hidden || a.ld_out < a.hidden) {
    return InvalidArgument("moe: row stride too small");
  }
  return absl::OkStatus();
}

absl::Status CheckMoe(const MoeArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckMoeShape(a));
  if (a.tokens == 0) return absl::OkStatus();
  for (int64_t i = 0; i < a.tokens * a.top_k; ++i) {
    if (a.ids[i] >= a.num_experts) {
      return InvalidArgument("moe: expert id ", a.ids[i], " >= ", a.num_experts);
    }
  }
  return absl::OkStatus();
}

int64_t NumHashChunks(const ChunkHashArgs& a) {
  if (a.total_bytes <= 0 || a.chunk_bytes <= 0) return 0;
  return (a.total_bytes + a.chunk_bytes - 1) / a.chunk_bytes;
}

absl::Status CheckChunkHashShape(const ChunkHashArgs& a) {
  if (a.chunk_bytes <= 0 || a.chunk_bytes > kMaxHashChunkBytes) {
    return InvalidArgument("chunk hashes: chunk_bytes ", a.chunk_bytes, " outside [1, ",
                           kMaxHashChunkBytes, "]");
  }
  if (a.total_bytes < 0 || a.num_segments < 0) {
    return InvalidArgument("chunk hashes: negative total_bytes or num_segments");
  }
  if (a.total_bytes > 0 && a.num_segments == 0) {
    return InvalidArgument("chunk hashes: ", a.total_bytes, " bytes but no segments");
  }
  if ((a.num_segments > 0 && a.segments == nullptr) ||
      (a.total_bytes > 0 && a.hashes == nullptr)) {
    return InvalidArgument("chunk hashes: null pointer");
  }
  return absl::OkStatus();
}

absl::Status CheckChunkHashes(const ChunkHashArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckChunkHashShape(a));
  int64_t at = 0;
  for (int64_t i = 0; i < a.num_segments; ++i) {
    const ByteSegment& s = a.segments[i];
    if (s.bytes < 0 || s.offset != at || (s.bytes > 0 && s.data == nullptr) ||
        s.bytes > a.total_bytes - at) {
      return InvalidArgument("chunk hashes: segment ", i, " (offset ", s.offset, ", ",
                             s.bytes, " bytes) does not continue the stream at ", at,
                             " of ", a.total_bytes, " bytes");
    }
    at += s.bytes;
  }
  if (at != a.total_bytes) {
    return InvalidArgument("chunk hashes: the segments hold ", at, " bytes, not ",
                           a.total_bytes);
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels
