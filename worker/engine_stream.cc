#include "worker/engine_stream.h"

#include <algorithm>
#include <memory>

#include "common/grpc_status.h"
#include "engine/sampling/proto_convert.h"

namespace tandem::worker {

tandem::v1::GenerateResponse OutputToMessage(const std::string& request_id,
                                             const engine::RequestOutput& out,
                                             bool return_text) {
  tandem::v1::GenerateResponse m;
  m.set_request_id(request_id);
  for (int32_t t : out.new_tokens) m.add_token_ids(t);
  for (const engine::SampleResult& r : out.logprobs) {
    engine::SampleResultToProto(r, m.add_logprobs());
  }
  for (const engine::SampleResult& r : out.prompt_logprobs) {
    engine::SampleResultToProto(r, m.add_prompt_logprobs());
  }
  if (return_text) m.set_text(out.text);
  if (out.finished) m.set_finish_reason(engine::FinishReasonToProto(out.finish_reason));
  return m;
}

OutputCallback StreamEngineOutputs(rpc::ResponseStream* stream, WorkerMetrics* metrics,
                                   EngineStreamOptions options) {
  struct State {
    EngineStreamOptions o;
    int32_t completion = 0;
    int32_t cached = 0;  // prompt tokens from the prefix cache
    absl::Time last = absl::InfinitePast();
    bool first_pending = true;
  };
  auto st = std::make_shared<State>();
  st->completion = options.tokens_already_sent;
  // With a first token already sent, the next one is an inter-token interval.
  if (options.tokens_already_sent > 0) st->last = absl::Now();
  st->o = std::move(options);
  return [stream, metrics, st](engine::Engine&,
                               const absl::StatusOr<engine::RequestOutput>& out) {
    if (!out.ok()) {
      if (metrics) metrics->CountRequest(st->o.rpc, "error");
      stream->Close(ToGrpcStatus(out.status()));
      return;
    }
    tandem::v1::GenerateResponse m =
        OutputToMessage(st->o.request_id, *out, st->o.return_text);
    if (st->first_pending) {
      st->first_pending = false;
      if (st->o.seed.has_value()) m.set_seed(*st->o.seed);
    }
    const absl::Time now = absl::Now();
    if (out->new_tokens.size() > 0 && metrics) {
      if (st->last == absl::InfinitePast()) {
        metrics->ttft->Observe(absl::ToDoubleSeconds(now - st->o.started));
      } else {
        metrics->inter_token->Observe(absl::ToDoubleSeconds(now - st->last));
      }
    }
    if (!out->new_tokens.empty()) st->last = now;
    st->completion += static_cast<int32_t>(out->new_tokens.size());
    st->cached = std::max(st->cached, static_cast<int32_t>(out->cached_prompt_tokens));
    if (out->finished) {
      tandem::v1::Usage* u = m.mutable_usage();
      u->set_prompt_tokens(st->o.prompt_tokens);
      u->set_completion_tokens(st->completion);
      u->set_cached_prompt_tokens(st->cached);
      u->set_total_seconds(absl::ToDoubleSeconds(now - st->o.started));
      stream->Push(std::move(m));
      if (metrics) metrics->CountRequest(st->o.rpc, "ok");
      stream->Close(grpc::Status::OK);
      return;
    }
    stream->Push(std::move(m));
  };
}

}  // namespace tandem::worker
