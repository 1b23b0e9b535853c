#include "worker/engine_loop.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace tandem::worker {

EngineLoop::EngineLoop(std::unique_ptr<engine::Engine> engine)
    : engine_(std::move(engine)) {
  PublishStats(*engine_);
  thread_ = std::thread([this] { Run(); });
  compile_thread_ = std::thread([this] { RunCompiles(); });
}

EngineLoop::~EngineLoop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  compile_thread_.join();  // after the compile in progress, if any (its budget)
  thread_.join();
}

void EngineLoop::Post(Command command) {
  absl::MutexLock l(&mu_);
  commands_.push_back(std::move(command));
}

Command EngineLoop::MakeAdd(engine::RequestId id, std::vector<int32_t> prompt,
                            engine::SamplingParams params, OutputCallback on_output,
                            std::string cache_salt,
                            std::vector<engine::MediaInput> media) {
  return [this, id, prompt = std::move(prompt), params = std::move(params),
          cb = std::move(on_output), salt = std::move(cache_salt),
          media = std::move(media)](engine::Engine& e) mutable {
    const int64_t n = prompt.size();
    absl::Status s =
        e.AddRequest(id, std::move(prompt), params, salt, std::move(media));
    if (!s.ok()) {
      cb(e, s);
      return;
    }
    callbacks_[id] = std::move(cb);
    queued_prompt_[id] = n;
  };
}

namespace {
bool NeedsCompile(const engine::SamplingParams& p) {
  return p.structured.has_value() && p.structured->compiled == nullptr;
}
}  // namespace

void EngineLoop::AddRequestOnLoopThread(engine::Engine& engine, engine::RequestId id,
                                        std::vector<int32_t> prompt,
                                        engine::SamplingParams params,
                                        OutputCallback on_output,
                                        std::string cache_salt,
                                        std::vector<engine::MediaInput> media) {
  if (!NeedsCompile(params)) {
    MakeAdd(id, std::move(prompt), std::move(params), std::move(on_output),
            std::move(cache_salt), std::move(media))(engine);
    return;
  }
  // Registered in compiling_ before AddRequest returns.
  AddRequest(id, std::move(prompt), std::move(params), std::move(on_output),
             std::move(cache_salt), std::move(media));
}

void EngineLoop::AddRequest(engine::RequestId id, std::vector<int32_t> prompt,
                            engine::SamplingParams params, OutputCallback on_output,
                            std::string cache_salt,
                            std::vector<engine::MediaInput> media) {
  if (!NeedsCompile(params)) {
    Post(MakeAdd(id, std::move(prompt), std::move(params), std::move(on_output),
                 std::move(cache_salt), std::move(media)));
    return;
  }
  {
    absl::MutexLock l(&mu_);
    compiling_.insert(id);
  }
  CompileAhead(
      std::move(params),
      [this, id, prompt = std::move(prompt), cb = std::move(on_output),
       salt = std::move(cache_salt),
       media = std::move(media)](absl::StatusOr<engine::SamplingParams> p) mutable {
        absl::MutexLock l(&mu_);
        if (compile_cancelled_.contains(id)) {
          compiling_.erase(id);
          compile_cancelled_.erase(id);
          return;
        }
        // The id stays in compiling_ until this command runs on the engine
        // thread: a CancelOnLoopThread queued ahead of it (posted while the
        // grammar compiled) must still find the request alive and stop it.
        Command add = p.ok() ? MakeAdd(id, std::move(prompt), *std::move(p),
                                       std::move(cb), std::move(salt), std::move(media))
                             : Command([cb = std::move(cb), s = p.status()](
                                           engine::Engine& e) { cb(e, s); });
        commands_.push_back([this, id, add = std::move(add)](engine::Engine& e) {
          {
            absl::MutexLock l(&mu_);
            compiling_.erase(id);
            if (compile_cancelled_.erase(id) > 0) return;  // never added
          }
          add(e);
        });
      });
}

void EngineLoop::CompileAhead(engine::SamplingParams params,
                              CompiledParamsCallback then) {
  if (!NeedsCompile(params)) {
    then(std::move(params));
    return;
  }
  absl::MutexLock l(&mu_);
  compile_jobs_.push_back({std::move(params), std::move(then)});
}

void EngineLoop::RunCompiles() {
  while (true) {
    CompileJob job;
    bool have_job = false;
    {
      absl::MutexLock l(&mu_);
      if (precompute_.empty()) {
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](EngineLoop* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                   return !self->compile_jobs_.empty() || self->stop_;
                                 },
                                 this),
                             absl::Milliseconds(100));
      }
      if (stop_) return;
      if (!compile_jobs_.empty()) {
        job = std::move(compile_jobs_.front());
        compile_jobs_.pop_front();
        have_job = true;
      }
    }
    if (!have_job) {
      // Idle: a slice of the oldest grammar's mask precompute.
      if (precompute_.empty()) continue;
      Precompute& p = precompute_.front();
      const absl::Time t0 = absl::Now();
      const bool done = p.grammar->PrecomputeMasks(t0 + absl::Milliseconds(5));
      p.spent += absl::Now() - t0;
      if (done || p.spent >= kMaskPrecomputeBudget ||
          p.grammar->mask_cache().entry_bytes() >= kMaskPrecomputeBytes) {
        precompute_.pop_front();
      }
      continue;
    }
    // Thread-safe (the engine's compiler and its cache); the engine thread
    // keeps stepping meanwhile.
    absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> g =
        engine_->CompileConstraint(*job.params.structured);
    if (!g.ok()) {
      job.then(g.status());
      continue;
    }
    const bool queued =
        std::any_of(precompute_.begin(), precompute_.end(),
                    [&](const Precompute& p) { return p.grammar == *g; });
    if (!queued && !(*g)->mask_cache().precomputed()) {
      precompute_.push_back({*g, absl::ZeroDuration()});
    }
    job.params.structured->compiled = *std::move(g);
    job.then(std::move(job.params));
  }
}

void EngineLoop::WatchOnLoopThread(engine::RequestId id, OutputCallback on_output) {
  callbacks_[id] = std::move(on_output);
}

void EngineLoop::Abort(engine::RequestId id) {
  {
    absl::MutexLock l(&mu_);
    if (compiling_.contains(id)) compile_cancelled_.insert(id);
  }
  Post([this, id](engine::Engine& e) {
    callbacks_.erase(id);
    queued_prompt_.erase(id);
    e.Abort(id).IgnoreError();  // NotFound when it already ended
  });
}

void EngineLoop::Cancel(engine::RequestId id, std::function<void()> if_alive) {
  {
    absl::MutexLock l(&mu_);
    if (compiling_.contains(id)) {  // never added: alive until now
      // Alive only for the first Cancel or Abort (the hook runs once).
      if (compile_cancelled_.insert(id).second && if_alive)
        commands_.push_back([f = std::move(if_alive)](engine::Engine&) { f(); });
      return;
    }
  }
  Post([this, id, if_alive = std::move(if_alive)](engine::Engine& e) {
    if (CancelOnLoopThread(e, id) && if_alive) if_alive();
  });
}

bool EngineLoop::CancelOnLoopThread(engine::Engine& e, engine::RequestId id) {
  {
    absl::MutexLock l(&mu_);
    if (compiling_.contains(id)) return compile_cancelled_.insert(id).second;
  }
  if (callbacks_.erase(id) == 0) return false;
  queued_prompt_.erase(id);
  e.Abort(id).IgnoreError();
  return true;
}

void EngineLoop::SetLayerProgressCallback(engine::LayerProgressCallback callback) {
  Post([callback = std::move(callback)](engine::Engine& e) mutable {
    e.set_layer_progress_callback(std::move(callback));
  });
}

absl::Status EngineLoop::health() const {
  absl::MutexLock l(&mu_);
  return health_;
}

EngineLoopStats EngineLoop::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

void EngineLoop::PublishStats(engine::Engine& e) {
  EngineLoopStats s;
  s.prefill_tokens = e.prefill_tokens();
  s.decode_tokens = e.decode_tokens();
  s.speculative = e.speculative_stats();
  s.prefix = e.prefix_caching_stats();
  s.timing = e.step_timing();
  s.graphs = e.graph_stats();
  s.comm = e.comm_stats();
  s.free_blocks = e.num_free_blocks();
  s.total_blocks = e.scheduler().config().num_blocks;
  s.free_slots = e.num_free_slots();
  s.total_slots = e.scheduler().config().num_slots;
  s.running = e.scheduler().num_running();
  s.waiting = e.scheduler().num_waiting();
  s.preemptions = e.scheduler().num_preemptions();
  s.unrecomputable_drops = e.unrecomputable_drops();
  for (const auto& [id, n] : queued_prompt_) s.queued_prefill_tokens += n;
  absl::MutexLock l(&mu_);
  s.steps = stats_.steps;
  stats_ = s;
}

void EngineLoop::Run() {
  engine::Engine& e = *engine_;
  while (true) {
    std::deque<Command> batch;
    {
      absl::MutexLock l(&mu_);
      if (commands_.empty() && !e.HasWork() && !stop_) {
        // Idle: park until a command arrives (bounded, so stop_ is always seen).
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](EngineLoop* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                   return !self->commands_.empty() || self->stop_;
                                 },
                                 this),
                             absl::Milliseconds(100));
      }
      if (stop_) return;
      batch.swap(commands_);
    }
    for (Command& c : batch) c(e);
    if (!batch.empty()) PublishStats(e);
    if (!e.HasWork()) continue;
    absl::StatusOr<std::vector<engine::RequestOutput>> outs = e.Step();
    {
      absl::MutexLock l(&mu_);
      ++stats_.steps;
    }
    if (!outs.ok()) {
      TLOG(ERROR, "engine step failed; failing every request")
          .Kv("status", outs.status());
      if (absl::Status h = e.health(); !h.ok()) {
        absl::MutexLock l(&mu_);
        health_ = h;
      }
      auto cbs = std::move(callbacks_);
      callbacks_.clear();
      queued_prompt_.clear();
      for (auto& [id, cb] : cbs) {
        cb(e, outs.status());  // before the abort: the blocks are still held
        e.Abort(id).IgnoreError();
      }
      PublishStats(e);
      continue;
    }
    for (const engine::RequestOutput& o : *outs) {
      queued_prompt_.erase(o.id);
      auto it = callbacks_.find(o.id);
      if (it == callbacks_.end()) continue;
      OutputCallback cb = it->second;
      if (o.finished) callbacks_.erase(it);
      cb(e, o);
    }
    PublishStats(e);
  }
}

}  // namespace tandem::worker
