// What a model would need and do on hardware we cannot run here: Kimi K3 (2.8T
// parameters) on a node of 8 B300s, from its published config and the same
// code that sizes and measures the small checkpoints. A projection, labelled as
// such wherever it is printed: its inputs are the config, the hardware's
// vendor figures and an efficiency measured elsewhere (or none: the roofline).
//
//   weights   SizeModelWeights(config, {r, tp}) for every rank: the bytes the
//             loader would map, by the loader's own walk (engine/runtime/weights.h)
//   memory    ResolveDeviceBudget + SizeCacheFromMemory, the worker's own sizing
//             (--gpu_memory_utilization 0.9, --max_num_seqs 256, --block_size 16,
//             5% for prefix snapshots: the worker's defaults), with each rank's
//             weights as in_use and an assumed activation peak
//   decode    DecodeStepBytes per rank (below; engine_bench's roofline uses the
//             same function), the step's bound = bytes / memory bandwidth, the
//             projected step = bound / efficiency + the collectives
//             (count * (latency + ring bytes / link bandwidth))
//   prefill   a prompt in chunks of the step budget: per chunk the larger of its
//             arithmetic (matrix FLOPs per token from the same weight walk, the
//             causal MLA attention, the KDA recurrence) at the BF16 tensor rate
//             and its weight bytes at the memory bandwidth
//   hand-off  the bytes a prefill worker sends for a prompt as Tandem sends them
//             today (rank r to rank r: each rank its copy of the replicated MLA
//             latent and its KDA heads), and what moving the latent once would
//             send; time over the node's network and over one GPU's link
#ifndef TANDEM_ENGINE_RUNTIME_PROJECTION_H_
#define TANDEM_ENGINE_RUNTIME_PROJECTION_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cache/cache_sizing.h"
#include "engine/model/config.h"
#include "engine/runtime/weights.h"

namespace tandem::engine {

// Bytes one decode step touches on one rank: the rank's dense weights (every
// BF16/F32 matrix slice, lm_head rows; not the embedding table, of which a
// token reads one row), the routed experts its tokens reach, the MLA latent
// cache of every sequence (replicated on every rank: each reads all of it) and
// its KDA heads' state (read and written).
struct DecodeStepBytes {
  double dense = 0;
  double experts = 0;
  double experts_touched = 0;  // distinct routed experts read, per MoE layer
  double mla_cache = 0;
  double kda_state = 0;
  double total() const { return dense + experts + mla_cache + kda_state; }
};

// Expected distinct experts among `owned` that a batch of `batch` tokens reaches
// when each token picks `top_k` of `num_experts` uniformly: owned * (1 - (1 -
// top_k / num_experts)^batch). Uniform routing is the assumption: a skewed
// router reaches fewer (and reads fewer bytes). batch 1: owned * top_k / E.
double ExpectedExpertsTouched(int64_t num_experts, int64_t top_k, int64_t owned,
                              int64_t batch);

// `w`: a rank's weights, loaded or sized (its shard says which rank of how
// many). `context`: tokens in each sequence's cache (the mean over the step).
DecodeStepBytes DecodeStepBytesPerRank(const ModelWeights& w, int64_t batch,
                                       double context);

// One GPU as its vendor lists it: the inputs of the projection.
struct HardwareProfile {
  std::string name;  // "b300"
  std::string description;
  int64_t memory_bytes = 0;      // per GPU
  double memory_bandwidth = 0;   // bytes/s per GPU
  double link_bandwidth = 0;     // bytes/s per GPU, one direction (NVLink)
  double network_bandwidth = 0;  // bytes/s per node (its NICs together)
  double bf16_flops = 0;         // dense BF16 tensor rate, FLOP/s per GPU
  std::string source;            // where the figures come from
};

// "b300", "h200", "h100" (case-insensitive); NOT_FOUND lists the known names.
absl::StatusOr<HardwareProfile> FindHardware(const std::string& name);
std::vector<std::string> KnownHardware();

struct ProjectionInput {
  model::ModelConfig config;
  int tp = 8;
  HardwareProfile hardware;
  double gpu_memory_utilization = 0.9;     // the workers' default
  int32_t max_num_seqs = 256;              // the workers' default
  int32_t block_size = 16;                 // the workers' default
  double prefix_snapshot_fraction = 0.05;  // --prefix_snapshot_memory's default
  // What a profiling forward at the largest step would add per GPU: not measured
  // for a model this size (assumed).
  int64_t activation_peak_bytes = int64_t{8} << 30;
  // Measured on a GPU (engine_bench --backend cuda): the share of the vendor's
  // memory bandwidth a device-to-device copy reaches there (copy / datasheet),
  // and per batch size the share of that copy bandwidth a decode step reaches
  // (decode_bandwidth_efficiency). A batch not measured takes the nearest
  // measured one (by ratio). Neither given: the roofline at the vendor's figure.
  double bandwidth_share = 1.0;
  std::map<int64_t, double> efficiency_by_batch;
  std::string efficiency_source = "roofline at the vendor's bandwidth (no measurement)";
  // One collective's fixed cost (launch, synchronisation), assumed.
  double collective_latency_s = 10e-6;
  // Bytes per value of the all-reduced activations (the engine reduces fp32).
  int bytes_per_activation = 4;
  std::vector<int64_t> batches = {1, 8, 32, 64};
  std::vector<int64_t> contexts = {4096, 32768, 131072, 1048576};
  std::vector<int64_t> handoff_prompts = {4096, 32768, 131072, 1048576};
  // Prefill: the step budget (DefaultMaxTokensPerStep on a large GPU) and the
  // share of the BF16 rate the kernels reach (assumed: the 0.5 of
  // cuBLASLt, which itself reaches about 0.8 of the datasheet on an H100).
  int64_t prefill_chunk = 8192;
  double prefill_efficiency = 0.4;
  // The GPU backend the prefill runs on, as tensor-core mma per product
  // (TensorWork): "cuda" (the workers' default) feeds the tensor cores
  // split-BF16 operands, so a matrix product (BF16 weights x split activations)
  // takes two and an attention product (both operands split) three; "cuda_bf16"
  // rounds them once, one each (kernels/README.md, "Precision").
  std::string backend = "cuda";
};

// Tensor-core mma per product of a GPU backend's prefill kernels: matrices
// (dense GEMMs, the MoE) and attention (MLA expanded, KDA chunked).
struct TensorWork {
  int matrix = 1;
  int attention = 1;
};
// "cuda": {2, 3}; "cuda_bf16": {1, 1}; else InvalidArgument.
absl::StatusOr<TensorWork> TensorWorkOf(const std::string& backend);

// FLOPs of one prompt token on one rank, besides attention: 2 x the matrix
// parameters it meets (the rank's slices and replicated matrices, not lm_head,
// which only the last token meets; the routed experts as top_k / tp of one
// expert's parameters per MoE layer, a uniform router's share).
double MatrixFlopsPerToken(const ModelWeights& w);
// Attention FLOPs on one rank for prompt positions [begin, end): MLA expanded
// (scores and values over every earlier position, the rank's heads) and the KDA
// recurrence (about 8 d^2 per head per token; linear in the positions).
double AttentionFlops(const model::ModelConfig& config, int tp, int64_t begin,
                      int64_t end);

struct DecodeProjection {
  int64_t batch = 0;
  int64_t context = 0;
  DecodeStepBytes bytes;     // per rank
  double roofline_s = 0;     // bytes / the vendor's memory bandwidth
  double efficiency = 1;     // bandwidth_share * the batch's measured efficiency
  double collectives_s = 0;  // count * (latency + ring bytes / link)
  double step_s = 0;         // roofline / efficiency + collectives
  double tokens_per_s = 0;   // batch / step (the node: one TP group)
  bool fits = false;         // batch * context within the cache and the slots
};

struct HandoffProjection {
  int64_t prompt_tokens = 0;
  double bytes_sent = 0;         // every rank's copy: tp * latent + the KDA state
  double bytes_latent_once = 0;  // the latent moved once: latent + the KDA state
  double network_s = 0;          // bytes_sent over the node's network
  double network_latent_once_s = 0;
  double link_s = 0;  // on one node: each rank's share over its own GPU link
};

struct PrefillProjection {
  int64_t prompt_tokens = 0;
  int64_t chunks = 0;
  double matrix_flops = 0;     // per rank, the whole prompt
  double attention_flops = 0;  // per rank
  double weight_bytes = 0;     // per rank: every chunk streams its weights
  // Tensor-core work: matrix * TensorWork::matrix + attention *
  // TensorWork::attention (the FLOPs the rate is spent on).
  double tensor_flops = 0;
  double bound_s = 0;          // sum over chunks of max(tensor / rate, bytes / bw)
  double at_efficiency_s = 0;  // the same with the rate * prefill_efficiency
  double tokens_per_s = 0;     // prompt / at_efficiency_s
};

struct Projection {
  ProjectionInput input;
  uint64_t total_weight_bytes = 0;  // the checkpoint's text tensors (TP 1)
  uint64_t max_rank_bytes = 0;      // the largest rank's weights
  uint64_t node_weight_bytes = 0;   // every rank's, replicated tensors counted per rank
  int collectives_per_step = 0;     // 2 + attention layers + FFN layers (TP > 1)
  DeviceMemoryUse memory;           // the device budget, as a worker resolves it
  CacheSizing cache;                // what the budget buys
  std::vector<DecodeProjection> decode;
  std::vector<HandoffProjection> handoff;
  std::vector<PrefillProjection> prefill;  // one per handoff_prompts entry
};

// INVALID_ARGUMENT for a TP size the config does not divide (CheckTpSize's
// message), a bandwidth share or efficiency outside (0, 1.5], an empty or non-positive
// batch or context list; RESOURCE_EXHAUSTED (ResolveDeviceBudget's message) when the
// weights and the activation peak leave no room for a cache.
absl::StatusOr<Projection> Project(const ProjectionInput& input);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_PROJECTION_H_
