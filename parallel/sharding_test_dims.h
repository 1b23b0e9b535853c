// The split dimensions of the published K3 config and of the generated mid and
// tiny configs, written out by hand: parallel/ knows no model config, so its
// sharding tests use these, and engine/runtime:shard_dims_test checks that
// ShardDimsOf(the real configs) gives exactly these.
#ifndef TANDEM_PARALLEL_SHARDING_TEST_DIMS_H_
#define TANDEM_PARALLEL_SHARDING_TEST_DIMS_H_

#include "parallel/sharding.h"

namespace tandem::parallel::testing {

// Positional: {kda_heads, kda_head_dim, mla_heads, dense_rows (intermediate_size),
// shared_rows (moe_intermediate_size * num_shared_experts), num_experts,
// vocab_size}.
inline ShardDims K3Dims() { return {96, 128, 96, 33792, 2 * 3072, 896, 163840}; }
inline ShardDims MidDims() { return {8, 128, 8, 2816, 2 * 512, 64, 163840}; }
inline ShardDims TinyDims() { return {4, 16, 4, 128, 2 * 64, 16, 163840}; }

}  // namespace tandem::parallel::testing

#endif  // TANDEM_PARALLEL_SHARDING_TEST_DIMS_H_
