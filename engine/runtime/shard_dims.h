// The engine's model config as parallel/'s split dimensions: parallel/sharding.h
// is pure and knows no model config, so the engine's callers (the weight loader,
// the cache, the TP executor) describe the model to it through this.
#ifndef TANDEM_ENGINE_RUNTIME_SHARD_DIMS_H_
#define TANDEM_ENGINE_RUNTIME_SHARD_DIMS_H_

#include "engine/model/config.h"
#include "parallel/sharding.h"

namespace tandem::engine {

// KDA heads and head_dim, MLA heads, dense and shared-expert rows, routed
// experts and vocabulary of `config`.
parallel::ShardDims ShardDimsOf(const model::ModelConfig& config);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_SHARD_DIMS_H_
