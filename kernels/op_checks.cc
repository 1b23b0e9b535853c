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

absl::Status CheckEmbeddingRows(int64_t vocab, int64_t first, int64_t rows) {
  if (vocab < 0 || first < 0 || rows < 0 || first > vocab - rows) {
    return InvalidArgument("embedding: rows [", first, ", ", first + rows,
                           ") are not inside the vocabulary [0, ", vocab, ")");
  }
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

absl::Status CheckRope2dShape(const float* x, int64_t ldx, const int32_t* pos,
                              int64_t tokens, int64_t heads, int64_t head_dim,
                              float theta) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim % 4 != 0) {
    return InvalidArgument("rope2d: bad shape (tokens ", tokens, ", heads ", heads,
                           ", head_dim ", head_dim,
                           "; head_dim must be a multiple of 4)");
  }
  if (!(theta > 1.0f) || !std::isfinite(theta)) {
    return InvalidArgument("rope2d: theta must be finite and > 1, got ", theta);
  }
  if (tokens == 0) return absl::OkStatus();
  if (x == nullptr || pos == nullptr) return InvalidArgument("rope2d: null pointer");
  if (tokens > 1 && ldx < heads * head_dim) {
    return InvalidArgument("rope2d: row stride ", ldx, " < ", heads * head_dim);
  }
  return absl::OkStatus();
}

absl::Status CheckRope2d(const float* x, int64_t ldx, const int32_t* pos,
                         int64_t tokens, int64_t heads, int64_t head_dim, float theta) {
  TANDEM_RETURN_IF_ERROR(CheckRope2dShape(x, ldx, pos, tokens, heads, head_dim, theta));
  for (int64_t i = 0; i < 2 * tokens; ++i) {
    if (pos[i] < 0 || pos[i] >= kMaxRopePosition) {
      return InvalidArgument("rope2d: position ", pos[i], " of token ", i / 2,
                             " is outside [0, ", kMaxRopePosition, ")");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckVisionAttentionShape(const VisionAttnArgs& a) {
  if (a.heads <= 0 || a.head_dim <= 0 || a.num_images < 0 || a.num_tokens < 0 ||
      a.max_seqlen < 0) {
    return InvalidArgument("vision_attention: bad shape");
  }
  if (!std::isfinite(a.scale)) return InvalidArgument("vision_attention: bad scale");
  if (a.num_images == 0 || a.num_tokens == 0) return absl::OkStatus();
  if (!a.cu_seqlens || !a.q || !a.k || !a.v || !a.out) {
    return InvalidArgument("vision_attention: null pointer");
  }
  const int64_t width = a.heads * a.head_dim;
  if (a.num_tokens > 1 && (a.ld_qkv < width || a.ld_out < width)) {
    return InvalidArgument("vision_attention: row stride too small (ld_qkv ", a.ld_qkv,
                           ", ld_out ", a.ld_out, ", width ", width, ")");
  }
  return absl::OkStatus();
}

absl::Status CheckVisionAttention(const VisionAttnArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckVisionAttentionShape(a));
  if (a.num_images == 0) return absl::OkStatus();
  if (a.cu_seqlens == nullptr) return InvalidArgument("vision_attention: null pointer");
  if (a.cu_seqlens[0] != 0)
    return InvalidArgument("vision_attention: cu_seqlens[0] != 0");
  for (int64_t i = 0; i < a.num_images; ++i) {
    const int64_t len = int64_t{a.cu_seqlens[i + 1]} - a.cu_seqlens[i];
    if (len < 0 || len > a.max_seqlen) {
      return InvalidArgument("vision_attention: image ", i, " has ", len,
                             " tokens (max_seqlen ", a.max_seqlen, ")");
    }
  }
  if (a.cu_seqlens[a.num_images] != a.num_tokens) {
    return InvalidArgument("vision_attention: cu_seqlens ends at ",
                           a.cu_seqlens[a.num_images], ", num_tokens is ",
                           a.num_tokens);
  }
  return absl::OkStatus();
}

absl::Status CheckMerge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                           int64_t d, const float* out, int64_t ldo) {
  if (grid_h < 0 || grid_w < 0 || d <= 0 || grid_h % 2 != 0 || grid_w % 2 != 0) {
    return InvalidArgument("merge2x2: the grid must be even and d > 0 (grid ", grid_h,
                           "x", grid_w, ", d ", d, ")");
  }
  if (grid_h == 0 || grid_w == 0) return absl::OkStatus();
  if (x == nullptr || out == nullptr) return InvalidArgument("merge2x2: null pointer");
  if (ldx < d || ldo < 4 * d) {
    return InvalidArgument("merge2x2: row stride too small (ldx ", ldx, ", ldo ", ldo,
                           ", d ", d, ")");
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels
