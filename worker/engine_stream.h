// Turns a request's engine outputs into GenerateResponse messages on a
// ResponseStream: tokens, logprobs, text deltas (when asked), and on the last
// message the finish reason and usage; an engine error ends the stream with its
// status. Records time to first token and inter-token latency.
#ifndef TANDEM_WORKER_ENGINE_STREAM_H_
#define TANDEM_WORKER_ENGINE_STREAM_H_

#include <optional>
#include <string>

#include "absl/time/time.h"
#include "rpc/response_stream.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem::worker {

struct EngineStreamOptions {
  std::string request_id;
  int32_t prompt_tokens = 0;
  bool return_text = false;
  std::optional<uint64_t> seed;  // reported on the first message
  const char* rpc = "Generate";  // for the request counter
  absl::Time started = absl::Now();
  // Tokens already sent before the engine's outputs (the prefilled first token),
  // counted in usage.completion_tokens; with it, TTFT was recorded by the caller.
  int32_t tokens_already_sent = 0;
};

// `stream` and `metrics` (may be null) are not owned; the stream must stay open
// until the callback saw the request end (the callback Closes it).
OutputCallback StreamEngineOutputs(rpc::ResponseStream* stream, WorkerMetrics* metrics,
                                   EngineStreamOptions options);

// One engine output as a message (no usage).
tandem::v1::GenerateResponse OutputToMessage(const std::string& request_id,
                                             const engine::RequestOutput& out,
                                             bool return_text);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_ENGINE_STREAM_H_
