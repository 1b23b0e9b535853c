// TEST FIXTURE ONLY: a Router service that streams scripted token ids, so the
// gateway can be tested (and benchmarked) before real workers exist. It reads
// the prompt (decoded with the real K3 tokenizer) and answers by rules:
//
//   prompt ends `<|open|>think<|sep|>`    → chat with thinking: a think
//                                            channel, then the response
//   prompt ends `<|open|>response<|sep|>` → chat without thinking
//   otherwise                             → plain completion text + [EOS]
//   contains a tool result message         → "The weather in Paris is sunny."
//   contains "#tool"                       → a get_weather(city="Paris") call
//   contains "#error:CODE"                 → fails at once with gRPC CODE
//   contains "#fail_midway"                → 3 tokens, then UNAVAILABLE
//   contains "#tokens:N"                   → N filler tokens, then the end
//   contains "#per_message:K"              → K tokens per message (default 1),
//                                            as a coalescing router sends them
//   contains "#paced" (Options::step > 0)  → one token per step of a shared
//                                            step clock (a decode engine's
//                                            batch step); tokens ready while a
//                                            write is in flight are coalesced
//                                            into the next message
//   the seed (when set) is written into the text (" seed=S"), so seeded
//   choices differ and repeat exactly.
// Honours max_tokens (finish LENGTH), logprobs/top_logprobs (made-up values:
// -0.5 - 0.1 * (k % 7), alternatives below it). Ignores stop strings on
// purpose: the gateway must apply them itself. GenerateSession runs the same
// scripts per stream id (rpc/session_stream.h merges what queues behind a
// write). Every call is reported to
// `events` (generate / cancelled / done) so tests can see what arrived.
#ifndef TANDEM_GATEWAY_TESTING_SCRIPTED_ROUTER_H_
#define TANDEM_GATEWAY_TESTING_SCRIPTED_ROUTER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "proto/router.grpc.pb.h"

namespace tandem::gateway::testing {

class ScriptedStream;
class ScriptedSessionRequest;

class ScriptedRouter final : public tandem::v1::Router::CallbackService {
 public:
  struct Options {
    std::string model_id = "kimi-k3";
    int64_t max_context_tokens = 4096;
    // Period of the step clock of "#paced" requests; zero: no clock ("#paced"
    // is ignored, the request streams at full speed).
    absl::Duration step = absl::ZeroDuration();
  };
  using EventSink = std::function<void(const nlohmann::json& event)>;

  // `tokenizer` is not owned. `events` may be empty; it is called from gRPC
  // threads (concurrently).
  ScriptedRouter(const tokenizer::Tokenizer* tokenizer, Options options,
                 EventSink events);
  // Stops the step clock; every call must have ended (server shut down).
  ~ScriptedRouter() override;

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const tandem::v1::GenerateRequest* request) override;
  grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
  GenerateSession(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const tandem::v1::ListModelsRequest* request,
      tandem::v1::ListModelsResponse* response) override;
  // Answers with what SetResetAnswer set (default: OK, workers "prefill-0" and
  // "decode-0" reset) and counts the call.
  grpc::ServerUnaryReactor* ResetPrefixCache(
      grpc::CallbackServerContext* context,
      const tandem::v1::ResetPrefixCacheRequest* request,
      tandem::v1::ResetPrefixCacheResponse* response) override;
  void SetResetAnswer(grpc::Status status, tandem::v1::ResetPrefixCacheResponse answer);
  int reset_calls() const;

  // The token ids the fixture generates for `request` (before max_tokens),
  // and the gRPC error it fails with (OK if none) after `fail_after` tokens
  // (-1: fails at once).
  struct Script {
    std::vector<int> ids;
    grpc::Status error;
    int fail_after = -1;
    int per_message = 1;
    bool paced = false;
  };
  Script Plan(const tandem::v1::GenerateRequest& request) const;

  void Emit(const nlohmann::json& event) const {
    if (events_) events_(event);
  }

  bool paced() const { return options_.step > absl::ZeroDuration(); }
  // Steps the clock has made so far.
  int64_t steps() const;
  // A "#paced" stream joins / leaves the step clock.
  void AddPaced(ScriptedStream* stream);
  void RemovePaced(ScriptedStream* stream);

 private:
  void StepLoop();
  void BurstLoop();

  const tokenizer::Tokenizer* tokenizer_;  // not owned
  const Options options_;
  const EventSink events_;

  mutable absl::Mutex paced_mu_;
  absl::flat_hash_set<ScriptedStream*> paced_streams_ ABSL_GUARDED_BY(paced_mu_);
  // Paced requests of GenerateSession calls, until they end.
  absl::flat_hash_set<std::shared_ptr<ScriptedSessionRequest>> paced_requests_
      ABSL_GUARDED_BY(paced_mu_);
  // Full-speed requests of GenerateSession calls, stepped every millisecond.
  absl::flat_hash_set<std::shared_ptr<ScriptedSessionRequest>> burst_requests_
      ABSL_GUARDED_BY(paced_mu_);
  std::thread burster_ ABSL_GUARDED_BY(paced_mu_);
  bool stopping_ ABSL_GUARDED_BY(paced_mu_) = false;
  int64_t steps_ ABSL_GUARDED_BY(paced_mu_) = 0;
  std::thread stepper_;

  mutable absl::Mutex reset_mu_;
  grpc::Status reset_status_ ABSL_GUARDED_BY(reset_mu_);
  tandem::v1::ResetPrefixCacheResponse reset_answer_ ABSL_GUARDED_BY(reset_mu_);
  bool reset_answer_set_ ABSL_GUARDED_BY(reset_mu_) = false;
  int reset_calls_ ABSL_GUARDED_BY(reset_mu_) = 0;
};

}  // namespace tandem::gateway::testing

#endif  // TANDEM_GATEWAY_TESTING_SCRIPTED_ROUTER_H_
