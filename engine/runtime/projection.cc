#include "engine/runtime/projection.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/shard_dims.h"
#include "parallel/sharding.h"

namespace tandem::engine {

double ExpectedExpertsTouched(int64_t num_experts, int64_t top_k, int64_t owned,
                              int64_t batch) {
  if (num_experts <= 0 || top_k <= 0 || owned <= 0 || batch <= 0) return 0;
  const double miss = 1.0 - static_cast<double>(std::min(top_k, num_experts)) /
                                static_cast<double>(num_experts);
  return static_cast<double>(owned) *
         (1.0 - std::pow(miss, static_cast<double>(batch)));
}

DecodeStepBytes DecodeStepBytesPerRank(const ModelWeights& w, int64_t batch,
                                       double context) {
  const model::ModelConfig& c = w.config;
  const int tp = std::max(1, w.shard.size);
  DecodeStepBytes b;
  b.dense = static_cast<double>(w.dense_bytes);
  const int64_t moe_layers = c.NumMoeLayers();
  // Round-robin: rank r owns the experts e with e % tp == r.
  const int64_t E = c.text.num_experts;
  const int64_t owned = E / tp + (w.shard.rank < E % tp ? 1 : 0);
  b.experts_touched =
      ExpectedExpertsTouched(E, c.text.num_experts_per_token, owned, batch);
  b.experts = static_cast<double>(moe_layers) * b.experts_touched *
              static_cast<double>(w.expert_bytes_each);
  b.mla_cache = static_cast<double>(batch) * context *
                static_cast<double>(c.NumMlaLayers() * c.MlaCacheBytesPerToken());
  b.kda_state = 2.0 * static_cast<double>(batch) *
                static_cast<double>(c.NumKdaLayers() * c.KdaStateBytesPerSequence()) /
                tp;
  return b;
}

absl::StatusOr<TensorWork> TensorWorkOf(const std::string& backend) {
  if (backend == "cuda") return TensorWork{2, 3};
  if (backend == "cuda_bf16") return TensorWork{1, 1};
  return InvalidArgument("projection: backend \"", backend,
                         "\" (the GPU backends: cuda, cuda_bf16)");
}

double MatrixFlopsPerToken(const ModelWeights& w) {
  const model::ModelConfig& c = w.config;
  const int tp = std::max(1, w.shard.size);
  const int64_t moe_layers = c.NumMoeLayers();
  // dense_bytes: BF16 matrices (and a few small fp32 vectors, under 0.1%), with
  // the rank's lm_head rows; an expert's bytes are 17/32 of a byte per weight
  // (a nibble and a 1/32 scale byte).
  const double lm_head = static_cast<double>(w.vocab_rows) * c.text.hidden_size * 2;
  const double dense_params = (static_cast<double>(w.dense_bytes) - lm_head) / 2;
  const double expert_params = static_cast<double>(w.expert_bytes_each) * 32 / 17;
  const double routed = static_cast<double>(moe_layers) * c.text.num_experts_per_token *
                        expert_params / tp;
  return 2 * (dense_params + routed);
}

double AttentionFlops(const model::ModelConfig& c, int tp, int64_t begin, int64_t end) {
  if (end <= begin) return 0;
  tp = std::max(1, tp);
  const double b = static_cast<double>(begin), e = static_cast<double>(end);
  // Sum over positions p in [begin, end) of the p + 1 positions p attends to.
  const double pairs = (e * (e + 1) - b * (b + 1)) / 2;
  const double mla_heads = static_cast<double>(c.text.num_attention_heads) / tp;
  const double per_pair =
      2.0 * mla_heads *
      static_cast<double>(c.text.qk_nope_head_dim + c.text.qk_rope_head_dim +
                          c.text.v_head_dim);
  const double d = static_cast<double>(c.text.linear_attn_config.head_dim);
  const double kda_heads =
      static_cast<double>(c.text.linear_attn_config.num_heads) / tp;
  return c.NumMlaLayers() * per_pair * pairs +
         c.NumKdaLayers() * kda_heads * 8 * d * d * (e - b);
}

namespace {

constexpr double kGB = 1e9;

std::vector<HardwareProfile> Profiles() {
  // Vendor figures (leads, not measurements): NVIDIA's B300 (HGX) and H200/H100
  // SXM datasheets; the node network of the AWS instance each is sold in.
  return {
      {"b300", "NVIDIA B300 (Blackwell Ultra, HGX), 8 per node (AWS p6-b300.48xlarge)",
       288'000'000'000, 8000 * kGB, 900 * kGB, 6400.0 / 8 * kGB, 2250e12,
       "NVIDIA: 288 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (900 GB/s each way), dense "
       "BF16 2.25 PFLOP/s; AWS p6-b300.48xlarge: 6.4 Tbps EFA"},
      {"h200", "NVIDIA H200 SXM, 8 per node (AWS p5en.48xlarge)", 141'000'000'000,
       4800 * kGB, 450 * kGB, 3200.0 / 8 * kGB, 989e12,
       "NVIDIA: 141 GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s (450 GB/s each way), dense "
       "BF16 989 TFLOP/s; AWS p5en.48xlarge: 3.2 Tbps EFA"},
      {"h100", "NVIDIA H100 SXM 80GB, 8 per node (AWS p5.48xlarge)", 80'000'000'000,
       3350 * kGB, 450 * kGB, 3200.0 / 8 * kGB, 989e12,
       "NVIDIA: 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (450 GB/s each way), dense "
       "BF16 989 TFLOP/s; AWS p5.48xlarge: 3.2 Tbps EFA"},
  };
}

// The measured efficiency of the nearest measured batch (by ratio); 1 when none.
double EfficiencyAt(const std::map<int64_t, double>& measured, int64_t batch) {
  double best = 1.0, best_distance = 0;
  bool found = false;
  for (const auto& [b, e] : measured) {
    const double distance = std::fabs(std::log(static_cast<double>(b) / batch));
    if (!found || distance < best_distance) {
      best = e;
      best_distance = distance;
      found = true;
    }
  }
  return best;
}

absl::Status CheckList(const std::vector<int64_t>& values, const char* what) {
  if (values.empty()) return InvalidArgument("projection: no ", what, " given");
  for (int64_t v : values) {
    if (v <= 0)
      return InvalidArgument("projection: ", what, " must be positive, got ", v);
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> KnownHardware() {
  std::vector<std::string> names;
  for (const HardwareProfile& p : Profiles()) names.push_back(p.name);
  return names;
}

absl::StatusOr<HardwareProfile> FindHardware(const std::string& name) {
  const std::string want = absl::AsciiStrToLower(name);
  for (const HardwareProfile& p : Profiles()) {
    if (p.name == want) return p;
  }
  return NotFound("unknown hardware \"", name,
                  "\"; known: ", absl::StrJoin(KnownHardware(), ", "));
}

absl::StatusOr<Projection> Project(const ProjectionInput& input) {
  const model::ModelConfig& c = input.config;
  const HardwareProfile& hw = input.hardware;
  if (input.tp < 1)
    return InvalidArgument("projection: tp must be >= 1, got ", input.tp);
  // Above 1 is possible where a step's reads beat a copy (caches); far above
  // is a wrong input.
  if (!(input.bandwidth_share > 0 && input.bandwidth_share <= 1.5)) {
    return InvalidArgument("projection: bandwidth share must be in (0, 1.5], got ",
                           input.bandwidth_share);
  }
  for (const auto& [batch, e] : input.efficiency_by_batch) {
    if (batch <= 0 || !(e > 0 && e <= 1.5)) {
      return InvalidArgument("projection: measured efficiency at batch ", batch,
                             " must be in (0, 1.5] for a positive batch, got ", e);
    }
  }
  if (hw.memory_bytes <= 0 || hw.memory_bandwidth <= 0 || hw.link_bandwidth <= 0 ||
      hw.network_bandwidth <= 0 || hw.bf16_flops <= 0) {
    return InvalidArgument("projection: hardware \"", hw.name,
                           "\" needs positive memory, bandwidths and network");
  }
  if (input.prefill_chunk <= 0 ||
      !(input.prefill_efficiency > 0 && input.prefill_efficiency <= 1)) {
    return InvalidArgument(
        "projection: the prefill chunk must be positive and its efficiency in (0, 1], "
        "got ",
        input.prefill_chunk, " and ", input.prefill_efficiency);
  }
  if (input.activation_peak_bytes < 0 || input.collective_latency_s < 0) {
    return InvalidArgument(
        "projection: activation peak and collective latency must "
        "not be negative");
  }
  TANDEM_RETURN_IF_ERROR(CheckList(input.batches, "batch sizes"));
  TANDEM_RETURN_IF_ERROR(CheckList(input.contexts, "context lengths"));
  TANDEM_RETURN_IF_ERROR(CheckList(input.handoff_prompts, "hand-off prompt lengths"));
  TANDEM_RETURN_IF_ERROR(parallel::CheckTpSize(ShardDimsOf(c), input.tp));

  Projection p;
  p.input = input;
  {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> whole, SizeModelWeights(c));
    p.total_weight_bytes = whole->rank_bytes;
  }
  // Every rank: the largest sets the budget (ResolveDeviceBudget takes the
  // smallest per-device room) and the step (the slowest rank).
  std::vector<std::unique_ptr<ModelWeights>> ranks;
  std::vector<DeviceMemoryMeasure> devices;
  for (int r = 0; r < input.tp; ++r) {
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ModelWeights> w,
                            SizeModelWeights(c, {r, input.tp}));
    p.max_rank_bytes = std::max(p.max_rank_bytes, w->rank_bytes);
    p.node_weight_bytes += w->rank_bytes;
    DeviceMemoryMeasure m;
    m.device = hw.name + ":" + std::to_string(r);
    m.total_bytes = hw.memory_bytes;
    m.weights_bytes = static_cast<int64_t>(w->rank_bytes);
    m.in_use_bytes = m.weights_bytes;
    m.free_bytes = std::max<int64_t>(0, m.total_bytes - m.in_use_bytes);
    m.activation_peak_bytes = input.activation_peak_bytes;
    devices.push_back(m);
    ranks.push_back(std::move(w));
  }

  // The worker's sizing, as worker/memory_sizing.cc runs it.
  DeviceBudgetInput budget;
  budget.devices = devices;
  budget.utilization = input.gpu_memory_utilization;
  budget.profile_tokens = 0;
  budget.min_cache_bytes =
      MinCacheBytes(WorkerCacheUnits(c, input.tp, input.block_size));
  absl::StatusOr<DeviceMemoryUse> use = ResolveDeviceBudget(budget);
  if (!use.ok()) {
    return absl::Status(use.status().code(),
                        absl::StrCat(c.model_type, " at TP ", input.tp, " on ", hw.name,
                                     " (", FormatBytes(p.max_rank_bytes),
                                     " of weights on the largest rank, an assumed ",
                                     FormatBytes(input.activation_peak_bytes),
                                     " activation peak): ", use.status().message()));
  }
  p.memory = *use;
  EngineOptions eo;
  eo.block_size = input.block_size;
  eo.tp.tp_size = input.tp;
  eo.prefix_caching.enabled = input.prefix_snapshot_fraction > 0;
  CacheMemoryOptions mem;
  mem.budget_bytes = p.memory.budget_bytes;
  mem.max_num_seqs = input.max_num_seqs;
  mem.prefix_snapshot_fraction = input.prefix_snapshot_fraction;
  TANDEM_ASSIGN_OR_RETURN(p.cache, SizeCacheFromMemory(c, mem, &eo));
  p.cache.device = p.memory;

  // Collectives per decode step at TP > 1 (ModelRunner::Forward): the embedding
  // all-reduce, one after each attention layer and each FFN layer, the logits
  // all-gather.
  const int layers = static_cast<int>(c.text.num_hidden_layers);
  p.collectives_per_step = input.tp > 1 ? 2 + 2 * layers : 0;
  const int64_t moe_layers = c.NumMoeLayers();
  const double H = static_cast<double>(c.text.hidden_size);
  const double L = static_cast<double>(c.text.routed_expert_hidden_size);
  const double V = static_cast<double>(c.text.vocab_size);
  const double ring = input.tp > 1 ? 2.0 * (input.tp - 1) / input.tp : 0.0;
  const double gather =
      input.tp > 1 ? static_cast<double>(input.tp - 1) / input.tp : 0.0;

  for (int64_t batch : input.batches) {
    for (int64_t context : input.contexts) {
      DecodeProjection d;
      d.batch = batch;
      d.context = context;
      // The slowest rank (rank 0 owns the most experts under round-robin).
      for (const auto& w : ranks) {
        DecodeStepBytes b =
            DecodeStepBytesPerRank(*w, batch, static_cast<double>(context));
        if (b.total() > d.bytes.total()) d.bytes = b;
      }
      d.roofline_s = d.bytes.total() / hw.memory_bandwidth;
      if (input.tp > 1) {
        const double act = static_cast<double>(batch) * input.bytes_per_activation;
        // Embedding + attention + dense FFN all-reduce [B, H]; MoE [B, L + H];
        // logits all-gathered [B, V].
        const double reduced = act * H * (1 + layers + (layers - moe_layers)) +
                               act * (L + H) * static_cast<double>(moe_layers);
        const double wire = ring * reduced + gather * act * V;
        d.collectives_s = p.collectives_per_step * input.collective_latency_s +
                          wire / hw.link_bandwidth;
      }
      d.efficiency =
          input.bandwidth_share * EfficiencyAt(input.efficiency_by_batch, batch);
      d.step_s = d.roofline_s / d.efficiency + d.collectives_s;
      d.tokens_per_s = static_cast<double>(batch) / d.step_s;
      d.fits = batch <= p.cache.num_slots && context <= p.cache.max_model_len &&
               batch * ((context + input.block_size - 1) / input.block_size) <=
                   p.cache.num_blocks;
      p.decode.push_back(d);
    }
  }

  const double latent_per_token =
      static_cast<double>(c.NumMlaLayers() * c.MlaCacheBytesPerToken());
  const double kda =
      static_cast<double>(c.NumKdaLayers() * c.KdaStateBytesPerSequence());
  for (int64_t prompt : input.handoff_prompts) {
    HandoffProjection h;
    h.prompt_tokens = prompt;
    const double latent = latent_per_token * static_cast<double>(prompt);
    h.bytes_sent = input.tp * latent + kda;
    h.bytes_latent_once = latent + kda;
    h.network_s = h.bytes_sent / hw.network_bandwidth;
    h.network_latent_once_s = h.bytes_latent_once / hw.network_bandwidth;
    h.link_s = (latent + kda / input.tp) / hw.link_bandwidth;
    p.handoff.push_back(h);
  }

  // Prefill on rank 0 (the most experts under round-robin).
  TANDEM_ASSIGN_OR_RETURN(const TensorWork work, TensorWorkOf(input.backend));
  const ModelWeights& r0 = *ranks[0];
  const double per_token = MatrixFlopsPerToken(r0);
  const double bandwidth = hw.memory_bandwidth * input.bandwidth_share;
  for (int64_t prompt : input.handoff_prompts) {
    PrefillProjection f;
    f.prompt_tokens = prompt;
    for (int64_t begin = 0; begin < prompt; begin += input.prefill_chunk) {
      const int64_t end = std::min(prompt, begin + input.prefill_chunk);
      const double matrix = per_token * static_cast<double>(end - begin);
      const double attention = AttentionFlops(c, input.tp, begin, end);
      // A chunk of (end - begin) tokens streams the weights it meets once.
      const DecodeStepBytes b = DecodeStepBytesPerRank(r0, end - begin, 0);
      const double bytes = b.dense + b.experts;
      const double tensor = matrix * work.matrix + attention * work.attention;
      f.matrix_flops += matrix;
      f.attention_flops += attention;
      f.tensor_flops += tensor;
      f.weight_bytes += bytes;
      ++f.chunks;
      f.bound_s += std::max(tensor / hw.bf16_flops, bytes / hw.memory_bandwidth);
      f.at_efficiency_s += std::max(tensor / (hw.bf16_flops * input.prefill_efficiency),
                                    bytes / bandwidth);
    }
    f.tokens_per_s = static_cast<double>(prompt) / f.at_efficiency_s;
    p.prefill.push_back(f);
  }
  return p;
}

}  // namespace tandem::engine
