// A worker's cache sizing at start (SizeWorkerCache): on cuda_sim, an emulated
// device of a chosen capacity ($TANDEM_SIM_DEVICE_BYTES, read when the backend
// is created) gives the budget --gpu_memory_utilization promises, measured
// from the tiny model's weights and a real profiling forward, and the engine
// then stays inside it while serving a step of the profiled size; too small a
// device fails loading naming the tensor that did not fit; the host backends
// size from --kv_cache_memory as before; the numbers are exported as gauges.
#include "worker/memory_sizing.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/cache/cache_sizing.h"
#include "engine/runtime/engine.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "worker/worker_metrics.h"
#include "worker/worker_model.h"

namespace tandem::worker {
namespace {

constexpr char kTiny[] = "engine/model/tiny_checkpoint";
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kStep = 64;  // --max_tokens_per_step: the profiled step

// The tiny model on cuda_sim with a device of `capacity` bytes.
absl::StatusOr<std::unique_ptr<WorkerModel>> LoadOnSim(int64_t capacity) {
  setenv("TANDEM_SIM_DEVICE_BYTES", std::to_string(capacity).c_str(), 1);
  auto m = LoadWorkerModel(kTiny, "cuda_sim", "");
  unsetenv("TANDEM_SIM_DEVICE_BYTES");
  return m;
}

engine::EngineOptions StepOptions() {
  engine::EngineOptions eo;
  eo.block_size = 16;
  eo.max_tokens_per_step = kStep;
  return eo;
}

WorkerMemoryFlags Flags(double utilization) {
  WorkerMemoryFlags f;
  f.gpu_memory_utilization = utilization;
  f.max_num_seqs = 8;
  f.prefix_snapshot_memory = 0;
  return f;
}

TEST(SizeWorkerCacheTest, SimDeviceBudgetIsUtilizationMinusWeightsAndPeak) {
  const int64_t capacity = 192 * kMiB;
  const double u = 0.75;
  auto model = LoadOnSim(capacity);
  ASSERT_TRUE(model.ok()) << model.status();
  kernels::Device& dev = (*model)->backend->device();
  ASSERT_EQ(dev.name(), "cuda_sim");
  const int64_t loaded = dev.MemoryInfo().allocated_bytes;
  engine::EngineOptions eo = StepOptions();
  absl::StatusOr<engine::CacheSizing> s = SizeWorkerCache(**model, Flags(u), &eo);
  ASSERT_TRUE(s.ok()) << s.status();
  const engine::DeviceMemoryUse& d = s->device;
  EXPECT_EQ(d.device, "cuda_sim");
  EXPECT_EQ(d.num_devices, 1);
  EXPECT_EQ(d.total_bytes, capacity);
  EXPECT_EQ(d.profile_tokens, kStep);
  EXPECT_EQ(d.source, "--gpu_memory_utilization=0.75");
  // In use: exactly what was allocated once the weights were placed; the
  // weights are the model's device bytes (tiny: 42 MiB, most of it the
  // embedding and lm_head).
  EXPECT_EQ(d.in_use_bytes, loaded);
  EXPECT_EQ(d.weights_bytes, static_cast<int64_t>((*model)->weights->device_bytes));
  EXPECT_GT(d.weights_bytes, 40 * kMiB);
  EXPECT_GE(d.in_use_bytes, d.weights_bytes);
  // The profile's peak holds at least the step's logits (8 rows, --max_num_seqs,
  // of the 163,840-token vocabulary, fp32) and its residual stream.
  EXPECT_GE(d.activation_peak_bytes, 8 * 163840 * 4);
  EXPECT_LT(d.activation_peak_bytes, 80 * kMiB);
  // The profile's temporary cache and runner are gone.
  EXPECT_LE(dev.MemoryInfo().allocated_bytes - loaded, d.activation_peak_bytes);
  // The budget: floor(u * capacity) - in use - peak.
  const int64_t budget = static_cast<int64_t>(std::floor(u * capacity)) -
                         d.in_use_bytes - d.activation_peak_bytes;
  EXPECT_EQ(d.budget_bytes, budget);
  EXPECT_EQ(s->budget_bytes, budget);
  // ... bought as SizeCache's arithmetic: 8 slots, then blocks.
  const model::ModelConfig& c = (*model)->checkpoint->config();
  const int64_t token_bytes = c.NumMlaLayers() * c.MlaCacheBytesPerToken();
  const int64_t slot_bytes = c.NumKdaLayers() * c.KdaStateBytesPerSequence();
  EXPECT_EQ(s->num_slots, 8);
  EXPECT_EQ(s->num_blocks, (budget - 8 * slot_bytes) / (16 * token_bytes));
  EXPECT_EQ(s->cache_tokens, s->num_blocks * 16);
  EXPECT_EQ(s->max_model_len, std::min<int64_t>(s->cache_tokens, 1048576));
  EXPECT_EQ(eo.num_blocks, s->num_blocks);
  EXPECT_EQ(eo.num_slots, 8);
  EXPECT_EQ(eo.max_context_tokens, s->max_model_len);
  const std::string line = s->Summary();
  EXPECT_NE(line.find("--gpu_memory_utilization=0.75 on 1 x cuda_sim"),
            std::string::npos)
      << line;

  // Exported as the worker's gauges (one device's bytes).
  metrics::Registry registry;
  WorkerMetrics wm(&registry);
  wm.SetCacheSizing(*s);
  auto gauge = [&](const char* kind) {
    return wm.gpu_memory->Add({{"kind", kind}}).Value();
  };
  EXPECT_EQ(gauge("total"), static_cast<double>(capacity));
  EXPECT_EQ(gauge("weights"), static_cast<double>(d.weights_bytes));
  EXPECT_EQ(gauge("other"), static_cast<double>(d.in_use_bytes - d.weights_bytes));
  EXPECT_EQ(gauge("activations"), static_cast<double>(d.activation_peak_bytes));
  EXPECT_EQ(gauge("kv_cache"), static_cast<double>(s->total_bytes()));
  EXPECT_EQ(wm.gpu_memory_utilization->Value(), u);
  EXPECT_EQ(wm.cache_capacity_blocks->Value(), static_cast<double>(s->num_blocks));

  // The engine's cache takes what the sizing said, and a step of the profiled
  // size stays within the utilization.
  auto engine = MakeEngine(model->get(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int64_t cache_bytes =
      static_cast<int64_t>((*engine)->executor().cache(0).total_bytes());
  EXPECT_EQ(cache_bytes, s->total_bytes());
  EXPECT_LE(cache_bytes, budget);
  // Besides the weights and the cache: only the backend's scratch the profile
  // grew (it stays with the backend), within the peak.
  EXPECT_LE(dev.MemoryInfo().allocated_bytes - loaded - cache_bytes,
            d.activation_peak_bytes);
  engine::SamplingParams greedy;
  greedy.max_tokens = 2;
  std::vector<int32_t> prompt(kStep);
  for (int64_t i = 0; i < kStep; ++i) prompt[i] = static_cast<int32_t>(100 + i);
  ASSERT_TRUE((*engine)->AddRequest(1, prompt, greedy).ok());
  bool finished = false;
  for (int step = 0; step < 8 && !finished; ++step) {
    auto out = (*engine)->Step();
    ASSERT_TRUE(out.ok()) << out.status();
    for (const engine::RequestOutput& o : *out) finished |= o.finished;
    EXPECT_LE(dev.MemoryInfo().allocated_bytes,
              static_cast<int64_t>(std::floor(u * capacity)))
        << "step " << step;
  }
  EXPECT_TRUE(finished);
}

// The profiled step computes logits for the rows a step can ask for: the
// sequences' last rows (--max_num_seqs), their drafts and the scored prompt rows
// (prompt logprobs; one here), not every token.
// What the worker holds beside the engine on the device (the prefill worker's
// vision tower: WorkerModel::extra_device_bytes) comes out of the budget, byte
// for byte, and shows as "other buffers" in use.
TEST(SizeWorkerCacheTest, ExtraDeviceBytesComeOutOfTheBudget) {
  // Two fresh models: a first sizing leaves the backend's lazily made buffers.
  const int64_t capacity = 192 * kMiB;
  auto model = LoadOnSim(capacity);
  ASSERT_TRUE(model.ok()) << model.status();
  engine::EngineOptions plain = StepOptions();
  auto without = SizeWorkerCache(**model, Flags(0.75), &plain);
  ASSERT_TRUE(without.ok()) << without.status();
  auto other = LoadOnSim(capacity);
  ASSERT_TRUE(other.ok()) << other.status();
  (*other)->extra_device_bytes = {7 * kMiB};
  engine::EngineOptions eo = StepOptions();
  auto with = SizeWorkerCache(**other, Flags(0.75), &eo);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_EQ(with->device.in_use_bytes, without->device.in_use_bytes + 7 * kMiB);
  EXPECT_EQ(with->device.weights_bytes, without->device.weights_bytes);
  EXPECT_EQ(with->device.activation_peak_bytes, without->device.activation_peak_bytes);
  EXPECT_EQ(with->budget_bytes, without->budget_bytes - 7 * kMiB);
  EXPECT_LT(with->num_blocks, without->num_blocks);
}

TEST(SizeWorkerCacheTest, ProfileLogitsForTheRowsAStepCanAskFor) {
  auto peak = [](int max_num_seqs, int drafts) -> int64_t {
    auto model = LoadOnSim(192 * kMiB);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return -1;
    engine::EngineOptions eo = StepOptions();
    eo.max_scored_tokens_per_step = 1;  // one scored prompt row per step
    WorkerMemoryFlags f = Flags(0.75);
    f.max_num_seqs = max_num_seqs;
    f.speculative_tokens = drafts;
    absl::StatusOr<engine::CacheSizing> s = SizeWorkerCache(**model, f, &eo);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->device.activation_peak_bytes : -1;
  };
  const int64_t row = 163840 * 4;     // one row of fp32 logits
  const int64_t two = peak(2, 0);     // 2 rows + 1 scored
  const int64_t ten = peak(2, 4);     // 2 * (1 + 4) rows + 1 scored
  const int64_t all = peak(1000, 0);  // capped at the step: 64 rows
  ASSERT_GT(two, 0);
  EXPECT_GE(ten - two, 8 * row);
  EXPECT_GE(all - ten, 53 * row);
  EXPECT_GE(all, kStep * row);
}

TEST(SizeWorkerCacheTest, TwoRanksProfileTheirOwnDevices) {
  // 256 MiB: a rank's step also holds its logits shard and the gathered
  // logits (126 MiB at 64 tokens; 192 MiB at 0.75 leaves no cache).
  const int64_t capacity = 256 * kMiB;
  auto model = LoadOnSim(capacity);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t full_in_use = (*model)->backend->device().MemoryInfo().allocated_bytes;
  engine::EngineOptions eo = StepOptions();
  eo.tp.tp_size = 2;
  // The ranks' backends are created by the profile (and later the engine) with
  // the capacity the environment gives them.
  setenv("TANDEM_SIM_DEVICE_BYTES", std::to_string(capacity).c_str(), 1);
  absl::StatusOr<engine::CacheSizing> s = SizeWorkerCache(**model, Flags(0.75), &eo);
  unsetenv("TANDEM_SIM_DEVICE_BYTES");
  ASSERT_TRUE(s.ok()) << s.status();
  const engine::DeviceMemoryUse& d = s->device;
  EXPECT_EQ(d.num_devices, 2);
  EXPECT_EQ(d.total_bytes, capacity);
  // A rank holds its shard: half the vocabulary's embedding and lm_head rows.
  EXPECT_LT(d.in_use_bytes, full_in_use);
  EXPECT_GT(d.weights_bytes, 20 * kMiB);
  EXPECT_GT(d.activation_peak_bytes, 0);
  // Twice the limiting rank's share; token bytes count both ranks' replicas.
  const int64_t per = static_cast<int64_t>(std::floor(0.75 * capacity)) -
                      d.in_use_bytes - d.activation_peak_bytes;
  EXPECT_EQ(d.budget_per_device_bytes, per);
  EXPECT_EQ(s->budget_bytes, 2 * per);
  const model::ModelConfig& c = (*model)->checkpoint->config();
  const int64_t token_bytes = 2 * c.NumMlaLayers() * c.MlaCacheBytesPerToken();
  const int64_t slot_bytes = c.NumKdaLayers() * c.KdaStateBytesPerSequence();
  EXPECT_EQ(s->num_blocks, (2 * per - 8 * slot_bytes) / (16 * token_bytes));
}

TEST(SizeWorkerCacheTest, KvCacheMemoryBytesOverrideOnADevice) {
  auto model = LoadOnSim(192 * kMiB);
  ASSERT_TRUE(model.ok()) << model.status();
  engine::EngineOptions eo = StepOptions();
  WorkerMemoryFlags f = Flags(0.9);
  f.kv_cache_memory = "16MiB";
  absl::StatusOr<engine::CacheSizing> s = SizeWorkerCache(**model, f, &eo);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->budget_bytes, 16 * kMiB);
  EXPECT_EQ(s->device.source, "--kv_cache_memory=16MiB");
  EXPECT_EQ(s->device.utilization, 0.0);
  EXPECT_EQ(s->device.activation_peak_bytes, 0);  // bytes: not profiled
  EXPECT_EQ(s->device.profile_tokens, 0);
  // More than the device has left is refused, naming what is free.
  f.kv_cache_memory = "1GiB";
  absl::Status big = SizeWorkerCache(**model, f, &eo).status();
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  EXPECT_NE(big.message().find("free"), std::string::npos) << big;
}

TEST(SizeWorkerCacheTest, UtilizationBelowWeightsAndPeakSaysWhatIsNeeded) {
  auto model = LoadOnSim(192 * kMiB);
  ASSERT_TRUE(model.ok()) << model.status();
  engine::EngineOptions eo = StepOptions();
  // 0.25 of 192 MiB = 48 MiB: the weights (42 MiB) and the profile do not fit.
  absl::Status s = SizeWorkerCache(**model, Flags(0.25), &eo).status();
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  for (const char* part :
       {"--gpu_memory_utilization=0.25", "cuda_sim (192.00 MiB", "the weights take",
        "activations at 64 tokens", "raise --gpu_memory_utilization to at least 0."}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << ": " << s;
  }
  EXPECT_EQ(SizeWorkerCache(**model, Flags(1.5), &eo).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SizeWorkerCache(**model, Flags(0), &eo).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SizeWorkerCacheTest, TooSmallDeviceFailsLoadingNamingTheTensor) {
  // 30 MiB: the embedding (20 MiB) fits, lm_head (20 MiB) does not.
  auto model = LoadOnSim(30 * kMiB);
  ASSERT_FALSE(model.ok());
  const absl::Status& s = model.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  for (const char* part :
       {"placing the model on cuda_sim: tensor lm_head (20.00 MiB) does not fit",
        "20.00 MiB of weights in 1 tensors placed so far",
        "of the device's 30.00 MiB"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << ": " << s;
  }
}

TEST(SizeWorkerCacheTest, HostBackendSizesFromKvCacheMemory) {
  auto model = LoadWorkerModel(kTiny, "cpu", "");
  ASSERT_TRUE(model.ok()) << model.status();
  engine::EngineOptions eo = StepOptions();
  WorkerMemoryFlags f = Flags(0.9);
  f.kv_cache_memory = "16MiB";
  absl::StatusOr<engine::CacheSizing> s = SizeWorkerCache(**model, f, &eo);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->budget_bytes, 16 * kMiB);
  EXPECT_TRUE(s->device.device.empty());
  // The default: 0.1 of MemAvailable.
  f.kv_cache_memory = "";
  s = SizeWorkerCache(**model, f, &eo);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->budget_bytes, 0);
  f.kv_cache_memory = "lots";
  EXPECT_EQ(SizeWorkerCache(**model, f, &eo).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::worker
