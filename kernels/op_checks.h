// Argument checks shared by every backend, so that all reject the same inputs
// with the same messages.
#ifndef TANDEM_KERNELS_OP_CHECKS_H_
#define TANDEM_KERNELS_OP_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace tandem::kernels {

absl::Status CheckGemm(const void* x, int64_t ldx, const void* w, int64_t ldw,
                       const float* y, int64_t ldy, int64_t m, int64_t n, int64_t k);
absl::Status CheckRows(int64_t rows, int64_t n, int64_t ld, const char* what);
// The row range [first, first + rows) of a vocab-row embedding (EmbeddingGatherRows).
absl::Status CheckEmbeddingRows(int64_t vocab, int64_t first, int64_t rows);
absl::Status CheckKda(const KdaArgs& a);
// CheckMla = CheckMlaShape (shapes, strides, null pointers: what a device backend
// checks on the host) + query_start, seq_lens and every block id of every
// sequence's used blocks (read on the host).
absl::Status CheckMlaShape(const MlaArgs& a);
absl::Status CheckMla(const MlaArgs& a);
// CheckMoe = CheckMoeShape (shapes, strides, null pointers: what a device backend
// checks on the host) + the expert ids < num_experts (read on the host).
absl::Status CheckMoeShape(const MoeArgs& a);
absl::Status CheckMoe(const MoeArgs& a);
// CheckChunkHashes = CheckChunkHashShape (sizes and null pointers: what a device
// backend checks on the host) + the segment table (read on the host): offsets
// contiguous from 0 to total_bytes, no negative sizes, no null data with bytes > 0.
absl::Status CheckChunkHashShape(const ChunkHashArgs& a);
absl::Status CheckChunkHashes(const ChunkHashArgs& a);
// ceil(total_bytes / chunk_bytes) (0 when either is <= 0).
int64_t NumHashChunks(const ChunkHashArgs& a);

// Vision ops. CheckRope2d / CheckVisionAttention also read the position and
// cu_seqlens tables (host-addressable backends); the *Shape forms do not.
absl::Status CheckRope2dShape(const float* x, int64_t ldx, const int32_t* pos,
                              int64_t tokens, int64_t heads, int64_t head_dim,
                              float theta);
absl::Status CheckRope2d(const float* x, int64_t ldx, const int32_t* pos,
                         int64_t tokens, int64_t heads, int64_t head_dim, float theta);
absl::Status CheckVisionAttentionShape(const VisionAttnArgs& a);
absl::Status CheckVisionAttention(const VisionAttnArgs& a);
absl::Status CheckMerge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                           int64_t d, const float* out, int64_t ldo);

// E2M1 values of MXFP4 codes 0..15 and the E8M0 scale of a byte.
extern const float kE2m1Values[16];
float E8m0ToF32(uint8_t s);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_OP_CHECKS_H_
