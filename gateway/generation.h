// One chat/completions (or completions) request in flight: its n router
// calls, a ChoiceDecoder per call, and the one HTTP response they make
// together (an SSE stream, or a whole JSON body when every choice is done).
//
// Lifecycle:
//
//               Start()
//   [created] ──────────> [calling]  n Router.Generate calls in flight
//                            │ OnResponse(i): decoder i → deltas → SSE chunks
//                            │   (the first output starts the stream, status 200;
//                            │   stream_interval holds tokens back, not the first)
//                            │ OnDone(i, OK) or a stop string: choice i finished
//                            │   (a stop string also cancels call i)
//                            ├─ every choice finished ─> Complete ─> [closed]
//                            │    stream: [usage chunk] + [DONE]; else one JSON body
//                            ├─ a call fails / bad router output ─> Fail ─> [closed]
//                            │    before the stream: an HTTP error; after it: an
//                            │    SSE error event + [DONE]; the other calls cancelled
//                            └─ client gone (recorded as 499) / Cancel() ─> [closed]
//                                 every call cancelled
//   [closed]: the response is over; later router output is dropped. The
//   object lives until the last call's callback releases it; ~Generation
//   leaves LiveGenerations (and takes its stream off active_streams).
//
// All state is under mu_; router calls are cancelled outside it. Router
// callbacks arrive on gRPC threads, OnClientGone on an HTTP I/O thread.
#ifndef TANDEM_GATEWAY_GENERATION_H_
#define TANDEM_GATEWAY_GENERATION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/api_error.h"
#include "gateway/choice_decoder.h"
#include "gateway/gateway_metrics.h"
#include "gateway/request_context.h"
#include "gateway/request_parser.h"
#include "gateway/router_client.h"
#include "nlohmann/json.hpp"
#include "proto/router.pb.h"

namespace tandem::gateway {

class Generation;

// The generations in flight, for a shutdown that cancels them all.
class LiveGenerations {
 public:
  void Add(Generation* g);
  void Remove(Generation* g);
  // Cancels every live generation and waits (up to `wait`) until all have
  // released their writers.
  void CancelAll(absl::Duration wait);
  int size() const;

 private:
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  absl::flat_hash_set<Generation*> live_ ABSL_GUARDED_BY(mu_);
};

// What a Generation uses of the service that starts it. Not owned; each must
// outlive every Generation.
struct GenerationDeps {
  const tokenizer::Tokenizer* tokenizer = nullptr;
  RouterClient* router = nullptr;
  GatewayMetrics* metrics = nullptr;
  LiveGenerations* live = nullptr;
  absl::Duration request_timeout = absl::Minutes(10);  // each router call's deadline
  int stream_interval = 1;  // see OpenAIServiceOptions::stream_interval
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  struct Choice {
    int prompt_index = 0;
    std::vector<int> prompt;
    std::optional<uint64_t> seed;
  };

  // Registers itself in `deps.live`. `choices` are the n router calls (n per
  // prompt for completions); `prompt_tokens` is their prompts' total for usage.
  Generation(std::shared_ptr<RequestContext> ctx, GenerationDeps deps, bool chat,
             std::string id, std::string model_name, std::string router_model,
             GenerationFields fields, ChoiceDecoder::Options decoder_options,
             std::vector<Choice> choices, int prompt_tokens);
  ~Generation();  // leaves deps.live
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // The structured-output constraint every call carries (before Start).
  void set_structured_output(tandem::v1::StructuredOutput so) {
    structured_output_ = std::move(so);
  }
  // The chat prompt's images (GenerateRequest.images) every call carries
  // (before Start).
  void set_images(std::vector<tandem::v1::ImageInput> images) {
    images_ = std::move(images);
  }
  // Starts the router calls and watches the client (call once, on a
  // shared_ptr: the calls' callbacks keep the Generation alive).
  void Start();
  // Ends the response where it is and cancels every router call (shutdown).
  void Cancel();

 private:
  struct ChoiceState {
    ChoiceState(const tokenizer::Tokenizer* t, ChoiceDecoder::Options o)
        : decoder(t, std::move(o)) {}
    ChoiceDecoder decoder;
    std::shared_ptr<GenerateCall> call;
    bool cancel_requested = false;
    bool role_sent = false;
    bool finished = false;
    size_t text_offset = 0;
    // Router output held back by stream_interval (has_pending: something is).
    tandem::v1::GenerateResponse pending;
    bool has_pending = false;
    bool output_sent = false;      // some of this choice's output went out
    int cached_prompt_tokens = 0;  // the router's usage: prompt tokens from a cache
    // Prompt logprobs (the first router message's): entry k scores prompt
    // token k + 1.
    std::vector<tandem::v1::TokenLogprob> prompt_scores;
    bool prompt_sent = false;  // streaming completions: the echo chunk went out
    bool first_message_seen = false;
  };

  tandem::v1::GenerateRequest BuildRequest(int i, absl::Time deadline) const;

  std::vector<std::shared_ptr<GenerateCall>> TakeCallsToCancel()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void ClientGone();

  // --- output ------------------------------------------------------------

  nlohmann::json ChunkBase() const;
  // Completions' echo: choice i's prompt as text.
  std::string PromptText(int i) const;
  // The alternatives of SamplingParams.prompt_logprobs the calls ask for
  // (prompt_logprobs, or echo with logprobs; the larger); -1: none.
  int PromptLogprobsAsked() const;
  // Streaming completions with echo or prompt_logprobs: choice i's first chunk,
  // the prompt (its text, logprobs) before any output; once.
  void WritePromptChunk(int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void WriteChunk(nlohmann::json choice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void StartStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The streamed form of `delta` for choice i (nothing when empty).
  void WriteDelta(int i, const ChoiceDelta& delta, const char* finish_reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // WriteDelta for the common case (text only: no tool calls, no logprobs),
  // rendered without a json object: the pre-rendered chunk tail plus the
  // escaped text. Byte for byte what dumping the json of WriteDelta gives
  // (nlohmann sorts keys: choices < created < id < model < object < usage;
  // delta < finish_reason < index < logprobs < text; content <
  // reasoning_content < role).
  void WriteTextDelta(int i, ChoiceState& st, const ChoiceDelta& delta,
                      const char* finish_reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static void AppendFinishIndex(std::string* out, int i, const char* finish_reason);

  // `],"created":...,"object":...[,"usage":null]}` and the SSE end: the part
  // of every chunk after its choice.
  std::string ChunkTail() const;

  nlohmann::json Usage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Fail(const ApiError& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- router callbacks ----------------------------------------------------

  void OnResponse(int i, const tandem::v1::GenerateResponse& r);

  // Feeds router output `r` of choice i to its decoder and streams the deltas.
  void ApplyLocked(int i, const tandem::v1::GenerateResponse& r,
                   std::vector<std::shared_ptr<GenerateCall>>* to_cancel_out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void OnDone(int i, const grpc::Status& status);

  std::shared_ptr<RequestContext> ctx_;
  const GenerationDeps deps_;
  const bool chat_;
  const std::string id_;
  const int64_t created_;
  const std::string model_name_;
  const std::string router_model_;
  const GenerationFields fields_;
  std::optional<tandem::v1::StructuredOutput> structured_output_;
  std::vector<tandem::v1::ImageInput> images_;
  const std::vector<Choice> choices_;
  const int prompt_tokens_;
  const std::string chunk_tail_ = ChunkTail();

  absl::Mutex mu_;
  std::vector<std::unique_ptr<ChoiceState>> state_ ABSL_GUARDED_BY(mu_);
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // the response is over
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;
  bool first_token_seen_ ABSL_GUARDED_BY(mu_) = false;
  metrics::Counter* tokens_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<ChoiceDelta> deltas_ ABSL_GUARDED_BY(mu_);  // reused per message
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_GENERATION_H_
