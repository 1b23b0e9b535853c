#include "engine/runtime/tp_executor.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/runtime/shard_dims.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "parallel/gloo_communicator.h"
#include "parallel/memory_store.h"
#include "parallel/nccl_communicator.h"
#include "parallel/sharding.h"

namespace tandem::engine {
namespace {

// Rank `rank`'s backend. The factory's backends with an explicit thread count:
// "cpu" and "cpu_bf16" are the factory's choices (kernels/backend_factory.cc)
// with `threads` instead of one per hardware thread, so N ranks share the
// machine instead of each starting a full-width pool. Device backends: rank r
// on GPU first + r, where "cuda:first" names the first (default 0); every
// cuda_sim rank is an emulated device of its own.
absl::StatusOr<std::unique_ptr<kernels::Backend>> MakeRankBackend(
    const std::string& name, int threads, int rank) {
  using kernels::CpuIsa;
  TANDEM_ASSIGN_OR_RETURN(kernels::BackendName parsed, kernels::ParseBackendName(name));
  if (parsed.kind == "cpu") {
    const CpuIsa isa = static_cast<CpuIsa>(std::min(
        static_cast<int>(kernels::ActiveIsa()), static_cast<int>(CpuIsa::kAvx512)));
    return kernels::CreateCpuBackend(isa, threads, /*use_onednn=*/false);
  }
  if (parsed.kind == "cpu_bf16")
    return kernels::CreateCpuBackend(kernels::ActiveIsa(), threads);
  if (parsed.kind == "cpu_reference") return kernels::CreateBackend(parsed.kind);
  auto backend = kernels::CreateBackend(parsed.kind, parsed.ordinal + rank);
  if (!backend.ok()) {
    return Annotate(backend.status(),
                    absl::StrCat("tensor-parallel rank ", rank, ": backend ", name,
                                 " on device ordinal ", parsed.ordinal + rank));
  }
  return backend;
}

bool IsCommError(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

// Members are destroyed bottom-up: the runner, communicator, cache and placed
// weights release their device memory before the backend (and its device) go.
struct TpExecutor::Rank {
  std::unique_ptr<kernels::Backend> own_backend;
  kernels::Backend* backend = nullptr;
  std::unique_ptr<ModelWeights> own_weights;
  const ModelWeights* weights = nullptr;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<parallel::Communicator> comm;  // null at TP 1
  parallel::NcclCommunicator* nccl = nullptr;    // not owned: `comm` when NCCL
  int ordinal = 0;                               // the rank's GPU (device backends)
  std::unique_ptr<ModelRunner> runner;
  std::thread thread;         // ranks >= 1 of a TP group
  std::vector<float> logits;  // ranks >= 1: their copy on the host device, unused
};

struct TpExecutor::Shared {
  parallel::MemoryStore store;
  absl::Mutex mu;
  bool stop ABSL_GUARDED_BY(mu) = false;
  int64_t step ABSL_GUARDED_BY(mu) = 0;  // the published step (1-based)
  // The step whose graph buffers the ranks prepare (ModelRunner::PrepareGraph),
  // published before that step when it captures.
  int64_t prepare ABSL_GUARDED_BY(mu) = 0;
  absl::Span<const SequenceInput> seqs ABSL_GUARDED_BY(mu);
  // Per rank.
  std::vector<bool> connected ABSL_GUARDED_BY(mu);
  std::vector<int64_t> done ABSL_GUARDED_BY(mu);  // last finished step
  std::vector<absl::Status> status ABSL_GUARDED_BY(mu);
  std::vector<int64_t> prepared ABSL_GUARDED_BY(mu);  // last prepared step
  std::vector<absl::Status> prepare_status ABSL_GUARDED_BY(mu);
  std::vector<bool> exited ABSL_GUARDED_BY(mu);
  std::vector<absl::Status> exit_status ABSL_GUARDED_BY(mu);
};

TpExecutor::TpExecutor() : shared_(std::make_unique<Shared>()) {}

TpExecutor::~TpExecutor() {
  {
    absl::MutexLock l(&shared_->mu);
    shared_->stop = true;
  }
  // Rank 0 releases its communicator while the rank threads release theirs (an
  // NCCL finalize may wait for the peers' finalize).
  if (!ranks_.empty()) {
    ranks_[0]->runner.reset();
    ranks_[0]->comm.reset();
  }
  for (auto& r : ranks_) {
    if (r->thread.joinable()) r->thread.join();
  }
}

namespace {

// The cache lives where the backend computes: on a device backend it is that
// device's memory (a worker then registers it with its transfer agent as device
// memory, worker/cache_layout.h). A cache allocator hands out host memory (a
// decode worker's agent-allocated shared memory on a CPU backend): a device
// backend cannot compute in it, so the combination is refused.
absl::Status PutCacheOnDevice(kernels::Backend* backend, KvCacheOptions* co) {
  kernels::Device& d = backend->device();
  if (d.name() == "host") return absl::OkStatus();
  if (co->allocator.allocate || co->allocator.release) {
    return FailedPrecondition(
        "the KV cache allocator hands out host memory; backend ", backend->name(),
        " computes in ", d.name(),
        " memory, so its cache comes from the device (leave "
        "EngineOptions::cache_allocator empty: the cache is then registered "
        "with the transfer agent as device memory)");
  }
  co->device = &d;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TpExecutor>> TpExecutor::CreateLocal(
    const ModelWeights* weights, kernels::Backend* backend, const KvCacheOptions& cache,
    const ModelRunnerOptions& runner) {
  if (weights->shard.size != 1) {
    return InvalidArgument("tp executor: CreateLocal needs unsharded weights, got TP ",
                           weights->shard.size);
  }
  auto ex = std::unique_ptr<TpExecutor>(new TpExecutor());
  ex->options_.cache = cache;
  ex->options_.runner = runner;
  auto r = std::make_unique<Rank>();
  r->weights = weights;
  r->backend = backend;
  KvCacheOptions co = cache;
  co.tp_rank = 0;
  co.tp_size = 1;
  TANDEM_RETURN_IF_ERROR(PutCacheOnDevice(backend, &co));
  TANDEM_ASSIGN_OR_RETURN(r->cache, KvCache::Create(weights->config, co));
  r->runner = std::make_unique<ModelRunner>(weights, r->cache.get(), backend, runner);
  ex->ranks_.push_back(std::move(r));
  return ex;
}

absl::StatusOr<std::unique_ptr<TpExecutor>> TpExecutor::Create(
    const model::Checkpoint& checkpoint, const TpExecutorOptions& options) {
  const int n = options.tp_size;
  TANDEM_RETURN_IF_ERROR(parallel::CheckTpSize(ShardDimsOf(checkpoint.config()), n));
  if (options.fail_rank == 0 || options.fail_rank >= n) {
    return InvalidArgument("tp executor: fail_rank ", options.fail_rank,
                           " is not a rank thread (1..", n - 1, ")");
  }
  auto ex = std::unique_ptr<TpExecutor>(new TpExecutor());
  ex->options_ = options;
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads =
      options.threads_per_rank > 0 ? options.threads_per_rank : std::max(1, hw / n);
  TANDEM_ASSIGN_OR_RETURN(kernels::BackendName parsed,
                          kernels::ParseBackendName(options.backend));
  const int first_ordinal = parsed.ordinal;
  for (int r = 0; r < n; ++r) {
    auto rk = std::make_unique<Rank>();
    TANDEM_ASSIGN_OR_RETURN(rk->own_backend,
                            MakeRankBackend(options.backend, threads, r));
    rk->backend = rk->own_backend.get();
    rk->ordinal = first_ordinal + r;
    TANDEM_ASSIGN_OR_RETURN(rk->own_weights,
                            LoadModelWeights(checkpoint, ShardSpec{r, n}));
    TANDEM_ASSIGN_OR_RETURN(
        rk->own_weights,
        PlaceModelWeights(std::move(rk->own_weights), rk->backend->device()));
    rk->weights = rk->own_weights.get();
    KvCacheOptions co = options.cache;
    co.tp_rank = r;
    co.tp_size = n;
    TANDEM_RETURN_IF_ERROR(PutCacheOnDevice(rk->backend, &co));
    TANDEM_ASSIGN_OR_RETURN(rk->cache, KvCache::Create(checkpoint.config(), co));
    ex->ranks_.push_back(std::move(rk));
  }
  if (n == 1) {
    Rank& r0 = *ex->ranks_[0];
    r0.runner = std::make_unique<ModelRunner>(r0.weights, r0.cache.get(), r0.backend,
                                              options.runner);
    return ex;
  }

  Shared& sh = *ex->shared_;
  {
    absl::MutexLock l(&sh.mu);
    sh.connected.assign(n, false);
    sh.done.assign(n, 0);
    sh.status.assign(n, absl::OkStatus());
    sh.prepared.assign(n, 0);
    sh.prepare_status.assign(n, absl::OkStatus());
    sh.exited.assign(n, false);
    sh.exit_status.assign(n, absl::OkStatus());
  }
  TpExecutor* self = ex.get();
  for (int r = 1; r < n; ++r) {
    ex->ranks_[r]->thread = std::thread([self, r] {
      Shared& sh = *self->shared_;
      Rank& rk = *self->ranks_[r];
      const TpExecutorOptions& o = self->options_;
      absl::Status exit_status = self->Connect(r);
      if (exit_status.ok()) {
        {
          absl::MutexLock l(&sh.mu);
          sh.connected[r] = true;
        }
        int64_t seen = 0, seen_prepare = 0;
        while (true) {
          absl::Span<const SequenceInput> seqs;
          bool prepare = false;
          {
            absl::MutexLock l(&sh.mu);
            auto ready = [&sh, seen,
                          seen_prepare]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sh.mu) {
              return sh.stop || sh.step > seen || sh.prepare > seen_prepare;
            };
            sh.mu.Await(absl::Condition(&ready));
            if (sh.stop) break;
            prepare = sh.prepare > seen_prepare;
            (prepare ? seen_prepare : seen) = prepare ? sh.prepare : sh.step;
            seqs = sh.seqs;
          }
          if (prepare) {
            // Local work only (allocations, an all-padding step without
            // collectives): its failure is this rank's alone.
            absl::Status s = rk.runner->PrepareGraph(seqs);
            absl::MutexLock l(&sh.mu);
            sh.prepared[r] = seen_prepare;
            sh.prepare_status[r] = std::move(s);
            continue;
          }
          if (r == o.fail_rank && seen - 1 == o.fail_rank_at_step) {
            exit_status = Internal("injected failure (fail_rank ", r,
                                   ", fail_rank_at_step ", o.fail_rank_at_step, ")");
            break;
          }
          absl::Status s =
              rk.runner->Forward(seqs, &rk.logits, LogitsPlacement::kDevice);
          absl::MutexLock l(&sh.mu);
          sh.done[r] = seen;
          sh.status[r] = std::move(s);
        }
      }
      // The graphs that captured the communicator's collectives go first: NCCL's
      // abort and destroy wait for them.
      if (rk.runner != nullptr) rk.runner->ReleaseGraphs();
      // Gloo: closing the connections fails the peers' pending collectives at
      // once. NCCL: a rank that stops abnormally aborts (ncclCommAbort); its peers
      // fail when their own timeout passes and abort in turn.
      if (!exit_status.ok() && rk.nccl != nullptr) rk.nccl->Abort();
      rk.nccl = nullptr;
      rk.comm.reset();
      absl::MutexLock l(&sh.mu);
      sh.exited[r] = true;
      sh.exit_status[r] = exit_status;
      sh.connected[r] = true;
    });
  }
  // Rank 0 connects on this thread while the others connect on theirs.
  absl::Status c0 = ex->Connect(0);
  if (!c0.ok()) return Annotate(c0, "tensor-parallel rank 0: connecting");
  absl::MutexLock l(&sh.mu);
  auto all_connected = [&sh]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sh.mu) {
    return std::all_of(sh.connected.begin() + 1, sh.connected.end(),
                       [](bool b) { return b; });
  };
  sh.mu.Await(absl::Condition(&all_connected));
  for (int r = 1; r < n; ++r) {
    if (sh.exited[r]) {
      return Annotate(sh.exit_status[r],
                      absl::StrCat("tensor-parallel rank ", r, ": connecting"));
    }
  }
  return ex;
}

// Rank r's communicator and runner, on the thread that runs rank r (for NCCL
// the thread's current device must be the rank's GPU, and stays so for its
// kernel launches). Gloo over loopback TCP when the rank computes in
// host-addressable memory (host, cuda_sim: the collectives read the device
// buffers in place after a synchronise); NCCL on the rank's GPU otherwise, its
// collectives enqueued on the backend's compute stream. Both rendezvous
// through the executor's MemoryStore.
absl::Status TpExecutor::Connect(int r) {
  Rank& rk = *ranks_[r];
  const TpExecutorOptions& o = options_;
  const int n = static_cast<int>(ranks_.size());
  kernels::Device& dev = rk.backend->device();
  TANDEM_RETURN_IF_ERROR(dev.MakeCurrent());
  if (dev.host_addressable()) {
    parallel::GlooOptions g;
    g.rank = r;
    g.size = n;
    g.store = &shared_->store;
    g.group = "tp_executor";
    g.hostname = o.hostname;
    g.timeout = o.timeout;
    auto comm = parallel::GlooCommunicator::Create(g);
    if (!comm.ok()) return comm.status();
    rk.comm = *std::move(comm);
  } else {
    parallel::NcclOptions no;
    no.rank = r;
    no.size = n;
    no.store = &shared_->store;
    no.group = "tp_executor";
    no.device = rk.ordinal;
    no.stream = dev.compute_stream().native();
    no.timeout = o.timeout;
    // The runner aborts it once its graphs are gone (ModelRunner::Forward).
    no.defer_abort = true;
    auto comm = parallel::NcclCommunicator::Create(no);
    if (!comm.ok()) return comm.status();
    rk.nccl = comm->get();
    rk.comm = *std::move(comm);
  }
  rk.runner = std::make_unique<ModelRunner>(rk.weights, rk.cache.get(), rk.backend,
                                            o.runner, rk.comm.get());
  return absl::OkStatus();
}

absl::Status TpExecutor::OnRank(size_t r) const {
  return ranks_[r]->backend->device().MakeCurrent();
}

absl::Status TpExecutor::Broken() const {
  return absl::UnavailableError(absl::StrCat(
      "tensor-parallel executor is broken (recreate it): ", broken_.message()));
}

absl::Status TpExecutor::health() const {
  return broken_.ok() ? absl::OkStatus() : Broken();
}

absl::Status TpExecutor::Forward(absl::Span<const SequenceInput> seqs,
                                 std::vector<float>* logits,
                                 LogitsPlacement placement) {
  if (!broken_.ok()) return Broken();
  const int n = tp_size();
  const int64_t step = ++steps_;
  // Slot operations on this thread may have left another rank's GPU current, and
  // a TP 1 runner on cuda:N must not rely on an earlier call having made it so.
  TANDEM_RETURN_IF_ERROR(OnRank(0));
  if (n == 1) return ranks_[0]->runner->Forward(seqs, logits, placement);
  // One CUDA-graph plan for every rank (the ranks are idle here): a graph only
  // where every rank may run one (rank 0 alone may have hooks; a rank whose
  // capture failed has graphs off), a capture where any rank must (a rank's
  // buffers moved: the draft model grows rank 0's workspace only). NCCL needs
  // a collective captured, and replayed, on all ranks or on none.
  GraphPlan plan;
  plan.use_graph = true;
  for (int r = 0; r < n; ++r) {
    const GraphPlan mine = ranks_[r]->runner->PlanGraph(seqs);
    plan.use_graph = plan.use_graph && mine.use_graph;
    plan.capture = plan.capture || mine.capture;
  }
  if (!plan.use_graph) plan.capture = false;
  Shared& sh = *shared_;
  // Every other rank: done with this step (or its preparation), or its thread
  // ended. The bound covers a rank that is still inside a collective when rank
  // 0 left (at most one communicator timeout), with room for the compute after
  // it.
  const absl::Duration bound = 2 * options_.timeout + absl::Seconds(10);
  // A capture's buffers on every rank first, each on its thread, before any
  // collective: a rank short of memory fails there alone, and the step runs
  // eagerly on every rank (that rank's graphs are off from now on, so every
  // later plan is eager too) rather than breaking the group.
  if (plan.capture) {
    {
      absl::MutexLock l(&sh.mu);
      sh.seqs = seqs;
      sh.prepare = step;
    }
    absl::Status prepared = ranks_[0]->runner->PrepareGraph(seqs);
    int failed = prepared.ok() ? -1 : 0;
    absl::MutexLock l(&sh.mu);
    auto all_prepared = [&sh, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sh.mu) {
      for (size_t r = 1; r < sh.prepared.size(); ++r) {
        if (sh.prepared[r] != step && !sh.exited[r]) return false;
      }
      return true;
    };
    if (!sh.mu.AwaitWithTimeout(absl::Condition(&all_prepared), bound)) {
      for (int r = 1; r < n; ++r) {
        if (sh.prepared[r] != step && !sh.exited[r]) {
          broken_ = absl::UnavailableError(absl::StrCat(
              "tensor-parallel rank ", r, " did not prepare step ", step,
              "'s CUDA graph buffers within ", absl::FormatDuration(bound)));
          return broken_;
        }
      }
    }
    for (int r = 1; r < n; ++r) {
      if (sh.exited[r]) {
        broken_ = absl::UnavailableError(
            absl::StrCat("tensor-parallel rank ", r, " ended its thread at step ", step,
                         ": ", sh.exit_status[r].ToString()));
        return broken_;
      }
      if (!sh.prepare_status[r].ok() && failed < 0) {
        failed = r;
        prepared = sh.prepare_status[r];
      }
    }
    if (failed >= 0) {
      TLOG(WARNING,
           "tensor parallelism: a rank could not size a CUDA graph's buffers; "
           "the step runs eagerly on every rank")
          .Kv("rank", failed)
          .Kv("step", step)
          .Kv("error", prepared);
      plan = GraphPlan{};
    }
  }
  for (int r = 0; r < n; ++r) ranks_[r]->runner->set_graph_plan(plan);
  {
    absl::MutexLock l(&sh.mu);
    sh.seqs = seqs;
    sh.step = step;
  }
  const absl::Status s0 = ranks_[0]->runner->Forward(seqs, logits, placement);

  std::vector<absl::Status> status(n);
  std::vector<bool> exited(n, false);
  std::vector<absl::Status> exit_status(n);
  status[0] = s0;
  bool finished = false;
  {
    absl::MutexLock l(&sh.mu);
    auto all_in = [&sh, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sh.mu) {
      for (size_t r = 1; r < sh.done.size(); ++r) {
        if (sh.done[r] != step && !sh.exited[r]) return false;
      }
      return true;
    };
    finished = sh.mu.AwaitWithTimeout(absl::Condition(&all_in), bound);
    for (int r = 1; r < n; ++r) {
      if (sh.done[r] == step) {
        status[r] = sh.status[r];
      } else if (sh.exited[r]) {
        exited[r] = true;
        exit_status[r] = sh.exit_status[r];
      } else {
        status[r] = absl::DeadlineExceededError(absl::StrCat(
            "did not finish step ", step, " within ", absl::FormatDuration(bound)));
      }
    }
  }
  // The root cause: a rank whose thread ended, else a rank with an error of its
  // own (not a collective failing because of a peer), else the lowest failing.
  int culprit = -1;
  for (int r = 1; r < n && culprit < 0; ++r) {
    if (exited[r]) culprit = r;
  }
  for (int r = 0; r < n && culprit < 0; ++r) {
    if (!status[r].ok() && !IsCommError(status[r])) culprit = r;
  }
  for (int r = 0; r < n && culprit < 0; ++r) {
    if (!status[r].ok()) culprit = r;
  }
  if (culprit < 0) return absl::OkStatus();
  // The same invalid-input error on every rank (a batch Validate refused before
  // any collective): the group is still in step, report it without breaking.
  bool same_everywhere = finished && absl::IsInvalidArgument(status[0]);
  for (int r = 1; r < n && same_everywhere; ++r) {
    same_everywhere = status[r] == status[0];
  }
  if (same_everywhere) return status[0];
  if (exited[culprit]) {
    broken_ = absl::UnavailableError(
        absl::StrCat("tensor-parallel rank ", culprit, " ended its thread at step ",
                     step, ": ", exit_status[culprit].ToString()));
  } else {
    broken_ = absl::UnavailableError(absl::StrCat("tensor-parallel rank ", culprit,
                                                  " failed at step ", step, ": ",
                                                  status[culprit].ToString()));
  }
  return broken_;
}

absl::Status TpExecutor::ResetSlot(int64_t slot) {
  if (!broken_.ok()) return Broken();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    TANDEM_RETURN_IF_ERROR(OnRank(r));
    TANDEM_RETURN_IF_ERROR(ranks_[r]->cache->ResetSlot(slot));
  }
  return OnRank(0);
}

absl::StatusOr<KdaSnapshot> TpExecutor::SnapshotSlot(int64_t slot) {
  if (!broken_.ok()) return Broken();
  if (ranks_.size() == 1) return ranks_[0]->cache->SnapshotSlot(slot);
  KdaSnapshot all;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    TANDEM_RETURN_IF_ERROR(OnRank(r));
    TANDEM_ASSIGN_OR_RETURN(KdaSnapshot one, ranks_[r]->cache->SnapshotSlot(slot));
    all.values.insert(all.values.end(), one.values.begin(), one.values.end());
  }
  TANDEM_RETURN_IF_ERROR(OnRank(0));
  return all;
}

absl::Status TpExecutor::RestoreSlot(int64_t slot, const KdaSnapshot& snapshot) {
  if (!broken_.ok()) return Broken();
  if (ranks_.size() == 1) return ranks_[0]->cache->RestoreSlot(slot, snapshot);
  size_t total = 0;
  for (auto& r : ranks_) total += r->cache->kda_bytes_per_slot() / sizeof(float);
  if (snapshot.values.size() != total) {
    return InvalidArgument("tp executor: snapshot has ", snapshot.values.size(),
                           " values, the ranks' slots hold ", total);
  }
  size_t off = 0;
  KdaSnapshot one;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const size_t count = ranks_[r]->cache->kda_bytes_per_slot() / sizeof(float);
    one.values.assign(snapshot.values.begin() + off,
                      snapshot.values.begin() + off + count);
    TANDEM_RETURN_IF_ERROR(OnRank(r));
    TANDEM_RETURN_IF_ERROR(ranks_[r]->cache->RestoreSlot(slot, one));
    off += count;
  }
  return OnRank(0);
}

absl::Status TpExecutor::CopySlot(int64_t from, int64_t to) {
  if (!broken_.ok()) return Broken();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    TANDEM_RETURN_IF_ERROR(OnRank(r));
    TANDEM_RETURN_IF_ERROR(ranks_[r]->cache->CopySlot(from, to));
  }
  return OnRank(0);
}

absl::StatusOr<std::vector<StateRange>> TpExecutor::ExportSequence(
    absl::Span<const int32_t> block_table, int64_t num_tokens, int64_t slot) {
  if (!broken_.ok()) return Broken();
  if (ranks_.size() == 1) {
    return ranks_[0]->cache->ExportSequence(block_table, num_tokens, slot);
  }
  std::vector<StateRange> all;
  for (auto& r : ranks_) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<StateRange> one,
                            r->cache->ExportSequence(block_table, num_tokens, slot));
    all.insert(all.end(), one.begin(), one.end());
  }
  return all;
}

const ModelWeights& TpExecutor::weights(int rank) const {
  return *ranks_[rank]->weights;
}
KvCache& TpExecutor::cache(int rank) { return *ranks_[rank]->cache; }
ModelRunner& TpExecutor::runner(int rank) { return *ranks_[rank]->runner; }
kernels::Backend& TpExecutor::backend(int rank) { return *ranks_[rank]->backend; }

CommStats TpExecutor::comm_stats() const { return ranks_[0]->runner->comm_stats(); }

void TpExecutor::reset_comm_stats() {
  for (auto& r : ranks_) {
    if (r->runner != nullptr) r->runner->reset_comm_stats();
  }
}

}  // namespace tandem::engine
