// CUDA graphs of decode steps (model_runner.h, "CUDA graphs") on the GPU backends
// ("cuda_sim" everywhere; "cuda" too where this binary has CUDA and a GPU):
//
//   - a runner with graphs and one with enforce_eager, driven through the same
//     schedule (prefills, then decode steps whose batch changes between 1, 3, 2
//     and 5 sequences: buckets 1, 4, 2 and 6 (the cache's 6 slots cap them), so
//     padded rows are in play, and buckets replayed later; then verification
//     steps of 2 drafts, width 3), give the same tokens and the same logits: bit for
//     bit on cuda_sim (the same kernels with the same arguments; the eager steps
//     plan MLA's split-KV as their bucket's graph does), within 1e-4 on cuda
//     (cuBLASLt may pick another algorithm for a padded row count);
//   - the graphs were really replayed (GraphStats counts), and a graph whose
//     buffers moved (a long prefill grows the activations) is recaptured, not
//     replayed over freed memory;
//   - padding is harmless: the KDA state and MLA cache rows of a sequence that is
//     not in a padded step are untouched by it (bytes compared);
//   - a device too full for the largest bucket's buffers runs the step eagerly.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/model/checkpoint.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/test_util.h"
#include "engine/runtime/weights.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "parallel/communicator.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::Feed;
using testing::MakeBackend;
using testing::MakeCacheOn;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeightsOn;

std::vector<std::string> GpuBackends() {
  std::vector<std::string> names;
  for (const char* n : {"cuda_sim", "cuda"}) {
    if (kernels::CreateBackend(n).ok()) names.push_back(n);
  }
  return names;
}

constexpr int64_t kSlots = 6;
constexpr int64_t kBlocksPerSeq = 4;

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<ModelRunner> runner;
};

Rig MakeRig(const std::string& backend, bool enforce_eager) {
  Rig r;
  r.backend = MakeBackend(backend.c_str());
  r.weights = TinyWeightsOn(*r.backend);
  r.cache = MakeCacheOn(*r.weights, *r.backend, kSlots * kBlocksPerSeq, 16, kSlots);
  ModelRunnerOptions o;
  o.enforce_eager = enforce_eager;
  r.runner =
      std::make_unique<ModelRunner>(r.weights.get(), r.cache.get(), r.backend.get(), o);
  return r;
}

// One step of the sequences `which`, each bringing `width` tokens (tokens[i * width
// ..]: a decode step for width 1, a verification step of width - 1 drafts) and
// wanting the logits of each; sets *logits to their rows.
absl::Status Decode(ModelRunner* runner, std::vector<TestSequence>* seqs,
                    const std::vector<int>& which, const std::vector<int32_t>& tokens,
                    std::vector<float>* logits, int width = 1) {
  std::vector<SequenceInput> batch(which.size());
  for (size_t i = 0; i < which.size(); ++i) {
    TestSequence& s = (*seqs)[which[i]];
    batch[i].tokens = absl::MakeConstSpan(&tokens[i * width], width);
    batch[i].start_pos = s.pos;
    batch[i].block_table = s.blocks;
    batch[i].kda_slot = s.slot;
    for (int j = 0; j < width; ++j) batch[i].logits_indices.push_back(j);
  }
  absl::Status st = runner->Forward(batch, logits);
  if (!st.ok()) return st;
  for (int i : which) (*seqs)[i].pos += width;
  return absl::OkStatus();
}

// The bytes of sequence `seq`'s KDA state (every layer) and of its MLA blocks.
std::vector<char> StateBytes(Rig& r, const TestSequence& seq) {
  std::vector<char> out;
  KvCache& c = *r.cache;
  kernels::Device& dev = r.backend->device();
  const size_t kda_bytes =
      c.num_slots() > 1 ? (c.kda_recurrent(1, 0) - c.kda_recurrent(0, 0)) * 4 : 0;
  auto read = [&](const void* p, size_t n) {
    const size_t at = out.size();
    out.resize(at + n);
    EXPECT_TRUE(dev.CopyToHost(out.data() + at, p, n).ok());
  };
  if (kda_bytes > 0) read(c.kda_recurrent(seq.slot, 0), kda_bytes);
  const size_t block_bytes = c.mla_layer_bytes() / c.num_blocks();
  for (int l = 0; l < c.num_mla_layers(); ++l) {
    for (int32_t b : seq.blocks) {
      read(reinterpret_cast<const char*>(c.mla_layer(l)) + b * block_bytes,
           block_bytes);
    }
  }
  return out;
}

class CudaGraphs : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaGraphs, GraphAndEagerDecodeGiveTheSameTokensAndLogits) {
  const bool exact = GetParam() == "cuda_sim";
  Rig graph = MakeRig(GetParam(), /*enforce_eager=*/false);
  Rig eager = MakeRig(GetParam(), /*enforce_eager=*/true);
  ASSERT_TRUE(graph.backend->device().supports_graphs());
  const int64_t V = graph.weights->config.text.vocab_size;

  std::vector<TestSequence> sg, se;
  std::vector<int32_t> next(kSlots);
  for (int i = 0; i < 5; ++i) {
    sg.push_back({BlockRange(i * kBlocksPerSeq, kBlocksPerSeq), i, 0});
    const std::vector<int32_t> prompt = MakePrompt(2 + i, 70 + i);
    std::vector<float> lg, le;
    ASSERT_TRUE(Feed(graph.runner.get(), &sg.back(), prompt, false, &lg).ok());
    se.push_back({BlockRange(i * kBlocksPerSeq, kBlocksPerSeq), i, 0});
    ASSERT_TRUE(Feed(eager.runner.get(), &se.back(), prompt, false, &le).ok());
    ASSERT_EQ(lg, le) << "prefill " << i;  // prefill is eager in both
    next[i] = Argmax(lg);
  }
  // Batches 1, 3, 2, 5 (buckets 1, 4, 2, 6), then 3 and 5 again (replays), then,
  // after a 60-token prefill that grows every activation buffer, 3 again; then two
  // verification steps of 2 drafts (width 3) over 3 sequences: captured, replayed.
  const std::vector<std::vector<int>> schedule = {
      {0},       {0, 1, 2}, {0, 1},   {0, 1, 2, 3, 4}, {1, 2, 4}, {0, 1, 2, 3, 4},
      {2, 3, 4}, {0, 1, 2}, {1, 3, 4}};
  int step = 0;
  for (const std::vector<int>& which : schedule) {
    const int width = step >= 7 ? 3 : 1;
    if (step == 6) {
      TestSequence big{BlockRange(5 * kBlocksPerSeq, kBlocksPerSeq), 5, 0};
      TestSequence big_e = big;
      const std::vector<int32_t> prompt = MakePrompt(60, 9);
      std::vector<float> lg, le;
      ASSERT_TRUE(Feed(graph.runner.get(), &big, prompt, false, &lg).ok());
      ASSERT_TRUE(Feed(eager.runner.get(), &big_e, prompt, false, &le).ok());
    }
    // A sequence outside this step: its state must not change (padding writes
    // nothing).
    int outside = -1;
    for (int i = 0; i < 5 && outside < 0; ++i) {
      if (std::find(which.begin(), which.end(), i) == which.end()) outside = i;
    }
    std::vector<char> before;
    if (outside >= 0) before = StateBytes(graph, sg[outside]);

    std::vector<int32_t> tokens;
    for (int i : which) {
      tokens.push_back(next[i]);
      for (int d = 1; d < width; ++d) tokens.push_back(100 + 7 * d + i);  // drafts
    }
    std::vector<float> lg, le;
    absl::Status st = Decode(graph.runner.get(), &sg, which, tokens, &lg, width);
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
    st = Decode(eager.runner.get(), &se, which, tokens, &le, width);
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
    ASSERT_EQ(lg.size(), which.size() * width * V);
    ASSERT_EQ(le.size(), lg.size());
    for (size_t r = 0; r < which.size() * width; ++r) {
      const size_t i = r / width;
      const absl::Span<const float> rg(lg.data() + r * V, V), re(le.data() + r * V, V);
      EXPECT_EQ(Argmax(rg), Argmax(re)) << "step " << step << " seq " << which[i];
      if (exact) {
        EXPECT_EQ(std::memcmp(rg.data(), re.data(), V * sizeof(float)), 0)
            << "step " << step << " seq " << which[i] << ": logits differ";
      } else {
        double worst = 0;
        for (int64_t v = 0; v < V; ++v) {
          worst = std::max(worst, static_cast<double>(std::fabs(rg[v] - re[v])));
        }
        EXPECT_LE(worst, 1e-4) << "step " << step << " seq " << which[i];
      }
      if ((r + 1) % width == 0) next[which[i]] = Argmax(rg);
    }
    if (outside >= 0) {
      EXPECT_TRUE(StateBytes(graph, sg[outside]) == before)
          << "step " << step << " changed the state of sequence " << outside
          << ", which is not in it";
    }
    ++step;
  }

  const GraphStats& gs = graph.runner->graph_stats();
  const GraphStats& es = eager.runner->graph_stats();
  std::printf(
      "graphs: %lld captured (%lld recaptured), %lld replays, %lld eager steps, "
      "%lld padded rows, %lld live graphs, %lld nodes, %lld input bytes, %lld "
      "capture bytes, %.3f s capturing\n",
      static_cast<long long>(gs.captures), static_cast<long long>(gs.recaptures),
      static_cast<long long>(gs.replays), static_cast<long long>(gs.eager_steps),
      static_cast<long long>(gs.padded_rows), static_cast<long long>(gs.live_graphs),
      static_cast<long long>(gs.graph_nodes), static_cast<long long>(gs.input_bytes),
      static_cast<long long>(gs.capture_device_bytes), gs.capture_seconds);
  EXPECT_TRUE(gs.disabled.empty()) << gs.disabled;
  // Buckets 1, 4, 2, 6 captured on first use; 4 and 6 replayed; bucket 4
  // recaptured after the prefill moved the activations; (4, width 3) captured,
  // then replayed.
  EXPECT_EQ(gs.captures, 6);
  EXPECT_EQ(gs.recaptures, 1);
  EXPECT_EQ(gs.replays, 3);
  EXPECT_EQ(gs.live_graphs, 5);
  EXPECT_EQ(gs.padded_rows, 0 + 1 + 0 + 1 + 1 + 1 + 1 + 3 + 3);
  EXPECT_GT(gs.graph_nodes, 0);
  EXPECT_EQ(es.captures, 0);
  EXPECT_EQ(es.replays, 0);
}

TEST_P(CudaGraphs, StepsThatAreNotPlainDecodeRunEagerly) {
  Rig graph = MakeRig(GetParam(), /*enforce_eager=*/false);
  std::vector<TestSequence> s = {{BlockRange(0, kBlocksPerSeq), 0, 0},
                                 {BlockRange(kBlocksPerSeq, kBlocksPerSeq), 1, 0}};
  std::vector<float> logits;
  const std::vector<int32_t> prompt = MakePrompt(3, 5);
  ASSERT_TRUE(Feed(graph.runner.get(), &s[0], prompt, false, &logits).ok());
  ASSERT_TRUE(Feed(graph.runner.get(), &s[1], prompt, false, &logits).ok());
  // A mixed step (a 2-token chunk next to a decode token) and a decode step
  // wanting no logits: eager.
  const std::vector<int32_t> two = {1, 2}, one = {3};
  std::vector<SequenceInput> mixed(2);
  mixed[0].tokens = two;
  mixed[0].start_pos = s[0].pos;
  mixed[0].block_table = s[0].blocks;
  mixed[0].kda_slot = 0;
  mixed[0].logits_indices = {1};
  mixed[1].tokens = one;
  mixed[1].start_pos = s[1].pos;
  mixed[1].block_table = s[1].blocks;
  mixed[1].kda_slot = 1;
  mixed[1].logits_indices = {0};
  ASSERT_TRUE(graph.runner->Forward(mixed, &logits).ok());
  const GraphStats after_mixed = graph.runner->graph_stats();
  EXPECT_EQ(after_mixed.captures, 0);
  EXPECT_EQ(after_mixed.eager_steps, 3);
  // A plain decode step of both: captured.
  s[0].pos += 2;
  s[1].pos += 1;
  ASSERT_TRUE(Decode(graph.runner.get(), &s, {0, 1}, {4, 5}, &logits).ok());
  EXPECT_EQ(graph.runner->graph_stats().captures, 1);
  EXPECT_EQ(graph.runner->graph_stats().eager_steps, 3);
}

// The emulator-only tests: cuda_sim fills its device to an exact capacity and
// takes a stand-in communicator; a --config=cuda build has no cuda_sim.
bool HasCudaSim() { return kernels::CreateBackend("cuda_sim").ok(); }

// A device too full for the largest bucket's buffers (the first capture sizes
// them): the step runs eagerly with the eager runner's logits, graphs stay off
// with the reason in GraphStats::disabled, and the buffers grown for the bucket
// are released so that the eager steps fit. On cuda_sim, whose capacity is
// exact (a CUDA pool may hold freed memory that cudaMemGetInfo does not count).
TEST(CudaGraphsShortOfMemory, TheStepRunsEagerlyAndGraphsTurnOff) {
  if (!HasCudaSim()) GTEST_SKIP() << "cuda_sim is not in this build";
  Rig graph = MakeRig("cuda_sim", /*enforce_eager=*/false);
  Rig eager = MakeRig("cuda_sim", /*enforce_eager=*/true);
  std::vector<TestSequence> gs = {{BlockRange(0, kBlocksPerSeq), 0, 0},
                                  {BlockRange(kBlocksPerSeq, kBlocksPerSeq), 1, 0}};
  std::vector<TestSequence> es = gs;
  std::vector<float> got, want;
  // Both prompts in one step (eager: not decode-shaped), a logits row each.
  const std::vector<int32_t> p0 = MakePrompt(3, 30), p1 = MakePrompt(4, 31);
  std::vector<SequenceInput> prefill(2);
  prefill[0].tokens = p0;
  prefill[1].tokens = p1;
  for (int i = 0; i < 2; ++i) {
    prefill[i].block_table = gs[i].blocks;
    prefill[i].kda_slot = i;
    prefill[i].logits_indices = {static_cast<int32_t>(prefill[i].tokens.size()) - 1};
  }
  ASSERT_TRUE(graph.runner->Forward(prefill, &got).ok());
  ASSERT_TRUE(eager.runner->Forward(prefill, &want).ok());
  ASSERT_EQ(got, want);
  gs[0].pos = es[0].pos = 3;
  gs[1].pos = es[1].pos = 4;
  // Fill the device but 256 KiB: the prefill's buffers hold 2.5 rows of logits
  // (655 KB a row), the largest bucket (6 sequences) needs 6.
  kernels::Device& dev = graph.backend->device();
  const int64_t free_bytes = dev.MemoryInfo().free_bytes;
  absl::StatusOr<kernels::DeviceBuffer> hog =
      kernels::DeviceBuffer::Allocate(&dev, free_bytes - (256 << 10));
  ASSERT_TRUE(hog.ok()) << hog.status();
  const int64_t V = graph.weights->config.text.vocab_size;
  std::vector<int32_t> next = {Argmax(absl::MakeConstSpan(got).subspan(0, V)),
                               Argmax(absl::MakeConstSpan(got).subspan(V, V))};
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(Decode(graph.runner.get(), &gs, {0, 1}, next, &got).ok()) << step;
    ASSERT_TRUE(Decode(eager.runner.get(), &es, {0, 1}, next, &want).ok()) << step;
    ASSERT_EQ(got, want) << step;
    next = {Argmax(absl::MakeConstSpan(got).subspan(0, V)),
            Argmax(absl::MakeConstSpan(got).subspan(V, V))};
  }
  const GraphStats st = graph.runner->graph_stats();
  EXPECT_EQ(st.captures, 0);
  EXPECT_EQ(st.replays, 0);
  EXPECT_EQ(st.live_graphs, 0);
  EXPECT_EQ(st.eager_steps, 1 + 3);
  EXPECT_NE(st.disabled.find("did not fit"), std::string::npos) << st.disabled;
  hog->Reset();
  // Graphs stay off once turned off (as after a failed capture).
  ASSERT_TRUE(Decode(graph.runner.get(), &gs, {0, 1}, next, &got).ok());
  ASSERT_TRUE(Decode(eager.runner.get(), &es, {0, 1}, next, &want).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(graph.runner->graph_stats().captures, 0);
}

// Rank 0 of a TP 2 group whose communicator defers its abort (NCCL's, in the
// TP executor): NCCL's abort waits, without a bound, for every graph that
// captured the communicator's collectives, so when a collective fails the
// runner must destroy its graphs before it aborts. The stand-in communicator
// enqueues nothing real (the outputs are not looked at), fails the wait of a
// chosen step as a timeout would, and records how many graphs were live when
// AbortNow came.
class DeferredAbortComm : public parallel::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Duration timeout() const override { return absl::Seconds(5); }
  absl::Status AllReduceSum(float*, size_t) override { return absl::OkStatus(); }
  absl::Status AllReduceSumBf16(uint16_t*, size_t) override { return absl::OkStatus(); }
  absl::Status AllGather(const float* in, size_t n, float* out) override {
    std::memcpy(out, in, n * sizeof(float));
    std::memcpy(out + n, in, n * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Broadcast(void*, size_t, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  bool stream_ordered() const override { return true; }
  absl::Status EnqueueAllReduceSum(float* d, size_t n) override {
    return AllReduceSum(d, n);
  }
  absl::Status EnqueueAllGather(const float* in, size_t n, float* out) override {
    return AllGather(in, n, out);
  }
  absl::Status WaitForStream() override {
    if (++waits_ != fail_wait_) return absl::OkStatus();
    pending_ = true;
    return absl::DeadlineExceededError("the step's collectives: not complete in time");
  }
  bool abort_pending() const override { return pending_; }
  void AbortNow() override {
    pending_ = false;
    ++aborts_;
    live_graphs_at_abort_ = runner_->graph_stats().live_graphs;
  }

  ModelRunner* runner_ = nullptr;
  int waits_ = 0, fail_wait_ = -1, aborts_ = 0;
  int64_t live_graphs_at_abort_ = -1;
  bool pending_ = false;
};

TEST(CudaGraphsDeferredAbort, TheGraphsGoBeforeTheCommunicatorAborts) {
  if (!HasCudaSim()) GTEST_SKIP() << "cuda_sim is not in this build";
  auto backend = MakeBackend("cuda_sim");
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto loaded = LoadModelWeights(**ckpt, ShardSpec{0, 2});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto weights = PlaceModelWeights(*std::move(loaded), backend->device());
  ASSERT_TRUE(weights.ok()) << weights.status();
  KvCacheOptions co;
  co.num_blocks = 8;
  co.block_size = 16;
  co.num_slots = 2;
  co.tp_rank = 0;
  co.tp_size = 2;
  co.device = &backend->device();
  auto cache = KvCache::Create((*weights)->config, co);
  ASSERT_TRUE(cache.ok()) << cache.status();
  DeferredAbortComm comm;
  ModelRunner runner(weights->get(), cache->get(), backend.get(), {}, &comm);
  comm.runner_ = &runner;

  std::vector<TestSequence> s = {{BlockRange(0, 4), 0, 0}};
  std::vector<float> logits;
  ASSERT_TRUE(Feed(&runner, &s[0], MakePrompt(5, 3), false, &logits).ok());
  // Decode: a capture, then replays; the third decode step's wait fails.
  comm.fail_wait_ = comm.waits_ + 3;
  ASSERT_TRUE(Decode(&runner, &s, {0}, {11}, &logits).ok());
  ASSERT_TRUE(Decode(&runner, &s, {0}, {12}, &logits).ok());
  EXPECT_EQ(runner.graph_stats().captures, 1);
  EXPECT_EQ(runner.graph_stats().replays, 1);
  EXPECT_EQ(runner.graph_stats().live_graphs, 1);
  EXPECT_EQ(comm.aborts_, 0);
  const absl::Status failed = Decode(&runner, &s, {0}, {13}, &logits);
  EXPECT_TRUE(absl::IsDeadlineExceeded(failed)) << failed;
  EXPECT_EQ(comm.aborts_, 1);
  EXPECT_EQ(comm.live_graphs_at_abort_, 0) << "aborted while a graph still existed";
  EXPECT_FALSE(comm.abort_pending());
}

TEST(GraphBuckets, PowersOfTwoThenStepsOf64UpToTheLargestBatch) {
  EXPECT_EQ(GraphBuckets(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(GraphBuckets(6), (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_EQ(GraphBuckets(256),
            (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 192, 256}));
  EXPECT_EQ(GraphBucket(0, 8), 0);
  EXPECT_EQ(GraphBucket(1, 8), 1);
  EXPECT_EQ(GraphBucket(3, 8), 4);
  EXPECT_EQ(GraphBucket(5, 6), 6);
  EXPECT_EQ(GraphBucket(7, 6), 0);
  EXPECT_EQ(GraphBucket(65, 256), 128);
  EXPECT_EQ(GraphBucket(129, 256), 192);
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaGraphs, ::testing::ValuesIn(GpuBackends()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param;
                         });
// A --config=cuda build on a machine without a GPU has no backend to run.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaGraphs);

}  // namespace
}  // namespace tandem::engine
