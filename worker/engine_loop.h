// EngineLoop: one dedicated thread owns a engine::Engine; everything else talks
// to it through a command queue.
//
//   Post(command) / AddRequest(id, prompt, params, on_output) / Abort(id)
//     → queue (mutex) → engine thread:
//   loop: drain commands (each runs with the Engine&) → Step() if HasWork()
//         → for each RequestOutput: its request's OnOutput callback (engine thread)
//         → park on the condvar when idle (bounded wait, 100 ms)
//
// Output callbacks run on the engine thread and may use the Engine they are
// given (ExportState, Locate, Abort); they must not block for long. Commands
// may also hold memory for state written in place (Engine::Reserve, the decode
// worker's reservations): not work, never stepped, until admitted. A request
// whose callback saw `finished` is forgotten. A failed Step() fails every
// request: each callback gets the error while the request still holds its
// blocks (so a callback can first stop transfers reading them), then the
// request is aborted. A failed step that broke the TP group (a dead rank)
// also makes health() return the error.
// Layer progress (SetLayerProgressCallback) is reported from inside Step(), on
// the engine thread, once per model layer of a step with prefill chunks.
// Thread-safe: every public method may be called from any thread.
#ifndef TANDEM_WORKER_ENGINE_LOOP_H_
#define TANDEM_WORKER_ENGINE_LOOP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/runtime/engine.h"

namespace tandem::worker {

// Gets each output of a request, or one error; runs on the engine thread.
using OutputCallback = std::function<void(
    engine::Engine& engine, const absl::StatusOr<engine::RequestOutput>&)>;
using Command = std::function<void(engine::Engine& engine)>;

// Counters the loop keeps (read from any thread).
struct EngineLoopStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;  // engine totals
  int64_t decode_tokens = 0;
  int32_t free_blocks = 0;
  int32_t total_blocks = 0;
  int32_t free_slots = 0;
  int32_t total_slots = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int64_t queued_prefill_tokens = 0;     // prompts added and not yet producing a token
  int64_t preemptions = 0;               // scheduler totals
  int64_t unrecomputable_drops = 0;      // Engine::unrecomputable_drops()
  engine::SpeculativeStats speculative;  // engine totals (zero when off)
  engine::PrefixCachingStats prefix;     // engine totals (zero when off)
  engine::StepTimingStats timing;        // forward time and host gaps
  engine::GraphStats graphs;             // rank 0's CUDA graphs (zero on the host)
  engine::CommStats comm;                // rank 0's TP collectives (zero at TP 1)
};

// Time the compile thread spends filling one grammar's mask cache ahead of use,
// and the cache's size past which it stops (a large schema's whole cache can
// reach 120 MB; the corpus' median is 0.3 MB); the rest fills on first use.
inline constexpr absl::Duration kMaskPrecomputeBudget = absl::Seconds(2);
inline constexpr int64_t kMaskPrecomputeBytes = int64_t{16} << 20;

class EngineLoop {
 public:
  // Starts the thread. The engine is owned by the loop.
  explicit EngineLoop(std::unique_ptr<engine::Engine> engine);
  ~EngineLoop();  // stops the thread (pending commands are dropped)
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Runs `command` on the engine thread, before the next step.
  void Post(Command command);
  // AddRequest on the engine thread; an error from it reaches `on_output`.
  // `cache_salt`: the request's prefix-cache namespace (its tenant; empty: the
  // shared one), engine::Engine::AddRequest.
  // `media`: the prompt's images as vision-tower rows (engine::MediaInput).
  void AddRequest(engine::RequestId id, std::vector<int32_t> prompt,
                  engine::SamplingParams params, OutputCallback on_output,
                  std::string cache_salt = {},
                  std::vector<engine::MediaInput> media = {});
  // A request with a structured-output constraint is first compiled on the
  // loop's compile thread (Engine::CompileConstraint; see CompileAhead) and
  // added after that, so a slow compile holds back only its own request, not
  // the running batch; a compile error reaches `on_output`. Abort and Cancel
  // also reach a request that is still compiling (it is then never added).
  //
  // Compiles params.structured, when set and not yet compiled, on the compile
  // thread, then calls `then` there with the params carrying the compiled
  // grammar (StructuredOutputSpec::compiled) or with the compile error;
  // without a constraint to compile, calls `then` at once on this thread.
  // `then` may Post; it must not block. Pending compiles are dropped when the
  // loop stops. While no compile is waiting, the compile thread fills the
  // token-mask cache of each grammar it compiled (CompiledGrammar::
  // PrecomputeMasks, in 5 ms slices, at most kMaskPrecomputeBudget and
  // kMaskPrecomputeBytes per grammar), so the first requests of a schema find
  // its states warm.
  using CompiledParamsCallback =
      std::function<void(absl::StatusOr<engine::SamplingParams> params)>;
  void CompileAhead(engine::SamplingParams params, CompiledParamsCallback then);
  // AddRequest from the engine thread (inside a Command), without a queue hop:
  // the request is known to the loop when this returns (added, or compiling),
  // so a CancelOnLoopThread queued behind the calling command finds it.
  void AddRequestOnLoopThread(engine::Engine& engine, engine::RequestId id,
                              std::vector<int32_t> prompt,
                              engine::SamplingParams params, OutputCallback on_output,
                              std::string cache_salt = {},
                              std::vector<engine::MediaInput> media = {});
  // Registers `on_output` for a request added by a command (e.g. a prefilled
  // admission); call on the engine thread only (inside a Command).
  void WatchOnLoopThread(engine::RequestId id, OutputCallback on_output);
  // Aborts the request or frees the reservation (engine::Engine::Abort: any
  // state, if still known) and drops its callback, which is not called again.
  // The decode worker gives reservations back this way (lease expiry, Release,
  // quarantine end, refused admission).
  void Abort(engine::RequestId id);

  // On the engine thread: when the request still has its callback (it has not
  // ended), aborts it, drops the callback and runs `if_alive` (e.g. closes its
  // stream); otherwise does nothing.
  void Cancel(engine::RequestId id, std::function<void()> if_alive);
  // The same, at once, on the engine thread (inside a Command or a callback):
  // returns whether the request was still alive (and is now aborted).
  bool CancelOnLoopThread(engine::Engine& engine, engine::RequestId id);

  // Installs the engine's layer-progress callback (engine::Engine::
  // set_layer_progress_callback) before the next step; nullptr removes it.
  void SetLayerProgressCallback(engine::LayerProgressCallback callback);

  // The engine's prefix-cache events since the last call, oldest first
  // (engine::Engine::TakePrefixEvents: thread-safe, so called from any thread,
  // e.g. the registration thread, without waiting for a step); empty when
  // prefix caching is off.
  std::vector<engine::PrefixEvent> TakePrefixEvents() {
    return engine_->TakePrefixEvents();
  }

  EngineLoopStats stats() const;
  // OK while the engine can step; after a step failed because the engine's
  // tensor-parallel group broke (a rank died), the executor's error
  // (UNAVAILABLE naming the rank): every later step fails the same way, so the
  // worker should stop taking work.
  absl::Status health() const;

 private:
  void Run();
  void RunCompiles();
  void PublishStats(engine::Engine& e) ABSL_LOCKS_EXCLUDED(mu_);
  Command MakeAdd(engine::RequestId id, std::vector<int32_t> prompt,
                  engine::SamplingParams params, OutputCallback on_output,
                  std::string cache_salt, std::vector<engine::MediaInput> media);

  // Used on thread_ only (but for its thread-safe TakePrefixEvents).
  std::unique_ptr<engine::Engine> engine_;
  absl::flat_hash_map<engine::RequestId, OutputCallback> callbacks_;  // thread_ only
  absl::flat_hash_map<engine::RequestId, int64_t> queued_prompt_;     // thread_ only
  mutable absl::Mutex mu_;
  std::deque<Command> commands_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineLoopStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  struct Precompute {
    std::shared_ptr<const grammar::CompiledGrammar> grammar;
    absl::Duration spent;
  };
  std::deque<Precompute> precompute_;  // compile_thread_ only
  struct CompileJob {
    engine::SamplingParams params;
    CompiledParamsCallback then;
  };
  std::deque<CompileJob> compile_jobs_ ABSL_GUARDED_BY(mu_);
  // AddRequest ids from the call until their add (or compile-error) command
  // runs on the engine thread: queued or compiling, or compiled with the
  // command still queued; and those of them aborted/cancelled (never added).
  absl::flat_hash_set<engine::RequestId> compiling_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<engine::RequestId> compile_cancelled_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  std::thread compile_thread_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_LOOP_H_
