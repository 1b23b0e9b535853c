#include "router/router_service.h"

#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/sampling/sampling_params.h"
#include "metrics/buckets.h"
#include "rpc/channel_users.h"
#include "rpc/deadline.h"
#include "rpc/response_stream.h"
#include "rpc/session_stream.h"

namespace tandem::router {
namespace {

using metrics::OrDie;

}  // namespace

RouterMetrics::RouterMetrics(metrics::Registry* registry)
    : requests(OrDie(registry->AddCounter(
          "tandem_router_requests_total",
          "Generate requests by outcome (ok, invalid, not_found, unavailable, "
          "resource_exhausted, cancelled, deadline_exceeded, data_loss, error)."))),
      in_flight(&OrDie(registry->AddGauge("tandem_router_requests_in_flight",
                                          "Generate calls running now."))
                     ->Add({})),
      latency(&OrDie(registry->AddHistogram(
                         "tandem_router_generate_duration_seconds",
                         "Generate calls from arrival to the end, every outcome.",
                         *metrics::ExponentialBuckets(0.001, 2, 16)))
                   ->Add({})),
      registrations(OrDie(registry->AddCounter(
          "tandem_router_registrations_total",
          "Worker registrations by role and result (ok, rejected)."))),
      workers(OrDie(registry->AddGauge("tandem_router_workers",
                                       "Live registered workers by role."))),
      sessions(&OrDie(registry->AddGauge(
                          "tandem_router_generate_sessions",
                          "Open GenerateSession calls (multiplexed clients such as "
                          "the gateway)."))
                    ->Add({})),
      session_writes(
          &OrDie(registry->AddCounter("tandem_router_session_writes_total",
                                      "Messages written on GenerateSession calls."))
               ->Add({})),
      session_events(&OrDie(registry->AddCounter(
                                "tandem_router_session_events_total",
                                "Events (request messages and ends) in them; events / "
                                "writes is the batching factor."))
                          ->Add({})) {
  // Children exist from the start, so every series is scraped (at 0) before the
  // first event and rate() works from the first scrape.
  for (const char* outcome :
       {"ok", "invalid", "not_found", "unavailable", "resource_exhausted", "cancelled",
        "deadline_exceeded", "data_loss", "error"}) {
    requests->Add({{"outcome", outcome}});
  }
  for (const char* role : {"prefill", "decode"}) workers->Add({{"role", role}});
}

RouterService::RouterService(model::ServedModel model, WorkerRegistry* registry,
                             RouterMetrics* metrics, Handoff* handoff,
                             RouterServiceOptions options,
                             const tokenizer::Tokenizer* tokenizer)
    : model_(std::move(model)),
      limits_{.vocab_size = model_.info.vocab_size(),
              .max_context_tokens = model_.info.max_context_tokens()},
      registry_(registry),
      metrics_(metrics),
      handoff_(handoff),
      options_(options),
      tokenizer_(tokenizer),
      structured_check_(tokenizer, model_.info.vocab_size()) {}

ModelLimits RouterService::Limits() const {
  ModelLimits limits = limits_;
  for (auto role : {tandem::v1::WORKER_ROLE_PREFILL, tandem::v1::WORKER_ROLE_DECODE}) {
    for (const WorkerRecord& w : registry_->Live(role)) {
      const int64_t c = w.registration.max_context_tokens();
      if (c > 0 && c < limits.max_context_tokens) limits.max_context_tokens = c;
    }
  }
  return limits;
}

namespace {

const char* Outcome(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return "ok";
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return "invalid";
    case absl::StatusCode::kNotFound:
      return "not_found";
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    case absl::StatusCode::kResourceExhausted:
      return "resource_exhausted";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kDeadlineExceeded:
      return "deadline_exceeded";
    case absl::StatusCode::kDataLoss:
      return "data_loss";
    default:
      return "error";
  }
}

}  // namespace

void RouterService::Done(const absl::Status& status, absl::Time started) {
  metrics_->requests->Add({{"outcome", Outcome(status)}}).Increment();
  metrics_->latency->Observe(absl::ToDoubleSeconds(absl::Now() - started));
}

absl::StatusOr<tandem::v1::GenerateRequest> RouterService::Admit(
    const tandem::v1::GenerateRequest& request) {
  tandem::v1::GenerateRequest req = request;
  const ModelLimits limits = Limits();
  TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(req, limits));
  if (!req.model().empty() && req.model() != model_.info.id()) {
    return NotFound("model '", req.model(), "' is not served here; served: '",
                    model_.info.id(), "'");
  }
  if (req.prompt_case() == tandem::v1::GenerateRequest::kPromptText) {
    if (tokenizer_ == nullptr) {
      return InvalidArgument("this router has no tokenizer; send prompt_token_ids");
    }
    absl::StatusOr<std::vector<int>> ids = tokenizer_->Encode(req.prompt_text());
    if (!ids.ok()) {
      return InvalidArgument("prompt_text cannot be tokenised: ",
                             ids.status().message());
    }
    if (ids->empty()) return InvalidArgument("prompt_text encodes to no tokens");
    tandem::v1::TokenIds* t = req.mutable_prompt_token_ids();  // clears the text
    for (int id : *ids) t->add_ids(id);
    TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(req, limits));
  }
  if (req.sampling().has_structured_output()) {
    // Compiled once here (cached by spec): an unsupported feature or a grammar
    // over budget is a 400 before any worker is asked.
    TANDEM_RETURN_IF_ERROR(structured_check_.Check(req.sampling().structured_output()));
    // Its end is a stop token: it cannot be ignored or held back.
    if (req.stop().ignore_eos()) {
      return InvalidArgument(
          "stop.ignore_eos cannot be combined with a structured output");
    }
    if (req.stop().min_tokens() > 0) {
      return InvalidArgument(
          "stop.min_tokens cannot be combined with a structured output");
    }
  }
  if (registry_->Live(tandem::v1::WORKER_ROLE_DECODE).empty()) {
    return Unavailable(
        "no decode workers registered with this router; the request was not started");
  }
  // Fields an older worker would ignore (unknown to it): refused while one is
  // live (a rolling upgrade) rather than lost.
  auto every_worker = [this](bool (tandem::v1::RegisterRequest::*has)() const,
                             const char* field) -> absl::Status {
    for (tandem::v1::WorkerRole role :
         {tandem::v1::WORKER_ROLE_PREFILL, tandem::v1::WORKER_ROLE_DECODE}) {
      for (const WorkerRecord& w : registry_->Live(role)) {
        if (!(w.registration.*has)()) {
          return Unavailable(field, ": worker '", w.registration.worker_id(),
                             "' predates ", field, " and would ignore it (an upgrade ",
                             "in progress?); the request was not started");
        }
      }
    }
    return absl::OkStatus();
  };
  if (req.sampling().logit_bias_size() > 0) {
    TANDEM_RETURN_IF_ERROR(
        every_worker(&tandem::v1::RegisterRequest::samples_logit_bias, "logit_bias"));
  }
  if (req.sampling().has_prompt_logprobs()) {
    TANDEM_RETURN_IF_ERROR(every_worker(
        &tandem::v1::RegisterRequest::computes_prompt_logprobs, "prompt_logprobs"));
  }
  if (req.request_id().empty()) req.set_request_id(ids_.Next("req-"));
  if (req.sampling().temperature() >= engine::kGreedyTemperature &&
      !req.sampling().has_seed()) {
    req.mutable_sampling()->set_seed(engine::FreshSeed());
  }
  return req;
}

// A request waiting for an in-flight place.
struct RouterService::Waiter {
  tandem::v1::GenerateRequest req;
  rpc::ResponseSink* sink;  // producer reference; Close()d when it ends here
  absl::Time deadline, started;
  QueuePlace place;
  absl::Mutex mu;
  uint64_t ticket ABSL_GUARDED_BY(mu) = 0;
  bool queued ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
};

bool RouterService::TryClaim() {
  int32_t n = in_flight_.load();
  while (n < options_.max_in_flight) {
    if (in_flight_.compare_exchange_weak(n, n + 1)) {
      metrics_->in_flight->Set(n + 1);
      return true;
    }
  }
  return false;
}

void RouterService::Run(const tandem::v1::GenerateRequest& request,
                        rpc::ResponseSink* sink, absl::Time grpc_deadline,
                        const std::string& peer) {
  const absl::Time started = absl::Now();
  absl::StatusOr<tandem::v1::GenerateRequest> req = Admit(request);
  if (!req.ok()) {
    Done(req.status(), started);
    TLOG(INFO, "generate refused")
        .Kv("request_id", request.request_id())
        .Kv("peer", peer)
        .Kv("status", req.status());
    sink->Close(ToGrpcStatus(req.status()));
    return;
  }
  const absl::Time deadline =
      rpc::WithUnixMillis(std::min(started + options_.request_timeout, grpc_deadline),
                          req->deadline_unix_ms());
  if (TryClaim()) {
    StartHandoff(*std::move(req), sink, deadline, started);
    return;
  }
  auto w = std::make_shared<Waiter>();
  w->req = *std::move(req);
  w->sink = sink;
  w->deadline = deadline;
  w->started = started;
  // Set before the Push, so that a wake's hand-off (which sets its own hook)
  // always comes after this one.
  sink->SetOnCancel([this, w] {
    uint64_t ticket;
    {
      absl::MutexLock l(&w->mu);
      w->cancelled = true;
      if (!w->queued) return;  // Wait() or the hand-off sees it
      ticket = w->ticket;
    }
    if (handoff_->queue()->Remove(ticket)) {
      const absl::Status s =
          absl::CancelledError("cancelled by the client while queued");
      Done(s, w->started);
      w->sink->Close(ToGrpcStatus(s));
    }
  });
  Wait(std::move(w));
}

void RouterService::Wait(std::shared_ptr<Waiter> w) {
  absl::Status refused;
  bool queued = false;
  {
    absl::MutexLock l(&w->mu);
    if (w->cancelled) {
      refused = absl::CancelledError("cancelled by the client while queued");
    } else {
      absl::StatusOr<uint64_t> ticket = handoff_->queue()->Push(
          AdmissionQueue::Lane::kInFlight, w->req.priority(), w->deadline, &w->place,
          [this, w](const absl::Status& s) {
            {
              absl::MutexLock l(&w->mu);
              w->queued = false;
            }
            if (!s.ok()) {
              Done(s, w->started);
              TLOG(INFO, "generate refused after queueing")
                  .Kv("request_id", w->req.request_id())
                  .Kv("status", s);
              w->sink->Close(ToGrpcStatus(s));
            } else if (TryClaim()) {
              StartHandoff(w->req, w->sink, w->deadline, w->started);
            } else {
              Wait(w);  // another took the place: back in line, same place
            }
          });
      if (ticket.ok()) {
        w->ticket = *ticket;
        w->queued = true;
        queued = true;
      }
      if (!queued) refused = ticket.status();
      if (!queued && absl::IsResourceExhausted(refused)) {
        refused =
            ResourceExhausted("the router is running ", options_.max_in_flight,
                              " requests (--max_in_flight) and ", refused.message());
      }
    }
  }
  if (queued) {
    // The place may have freed between the failed claim and the Push (its finish
    // found the lane empty): look again now that the request is in line, outside
    // w->mu (the wake may run this waiter's on_end, which takes it).
    if (in_flight_.load() < options_.max_in_flight) {
      handoff_->queue()->Wake(AdmissionQueue::Lane::kInFlight, 1);
    }
    return;
  }
  Done(refused, w->started);
  w->sink->Close(ToGrpcStatus(refused));
}

void RouterService::StartHandoff(tandem::v1::GenerateRequest req,
                                 rpc::ResponseSink* sink, absl::Time deadline,
                                 absl::Time started) {
  TLOG(DEBUG, "generate")
      .Kv("request_id", req.request_id())
      .Kv("prompt_tokens", req.prompt_token_ids().ids_size());
  handoff_->Start(std::move(req), sink, deadline, started,
                  [this, started](const absl::Status& s) {
                    metrics_->in_flight->Set(--in_flight_);
                    Done(s, started);
                    // Capacity may have freed: an in-flight place, and the
                    // decode worker's room (its next report says how much).
                    handoff_->queue()->Wake(AdmissionQueue::Lane::kInFlight, 1);
                    handoff_->CapacityMayHaveFreed(1);
                  });
}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* RouterService::Generate(
    grpc::CallbackServerContext* context, const tandem::v1::GenerateRequest* request) {
  auto* stream = new rpc::ResponseStream();
  Run(*request, stream, rpc::ContextDeadline(*context), context->peer());
  return stream;
}

grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
RouterService::GenerateSession(grpc::CallbackServerContext* context) {
  metrics_->sessions->Increment();
  TLOG(INFO, "generate session opened").Kv("peer", context->peer());
  return new rpc::SessionStream(
      [this, peer = context->peer()](tandem::v1::GenerateRequest request,
                                     rpc::ResponseSink* sink) {
        Run(request, sink, absl::InfiniteFuture(), peer);
      },
      {.on_write =
           [this](int64_t events) {
             metrics_->session_writes->Increment();
             metrics_->session_events->Increment(static_cast<double>(events));
           },
       .on_done =
           [this, peer = context->peer()](const rpc::SessionStream::Stats& stats) {
             metrics_->sessions->Decrement();
             TLOG(INFO, "generate session closed")
                 .Kv("peer", peer)
                 .Kv("requests", stats.started)
                 .Kv("writes", stats.writes)
                 .Kv("events", stats.events)
                 .Kv("coalesced", stats.coalesced);
           }});
}

grpc::ServerUnaryReactor* RouterService::ListModels(
    grpc::CallbackServerContext* context, const tandem::v1::ListModelsRequest*,
    tandem::v1::ListModelsResponse* response) {
  tandem::v1::ModelInfo* info = response->add_models();
  *info = model_.info;
  info->set_max_context_tokens(Limits().max_context_tokens);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

// One ResetPrefixCache fan-out: the workers' answers, gathered until the last
// one arrives, then the router's response and the call's end.
struct ResetFanOut {
  rpc::ChannelUsers::Use use;  // first: outlives the targets' contexts
  struct Target {
    std::string worker_id;
    std::string role;
    std::unique_ptr<grpc::ClientContext> context;
    tandem::v1::WorkerResetPrefixCacheResponse response;
  };
  grpc::ServerUnaryReactor* reactor = nullptr;
  tandem::v1::ResetPrefixCacheResponse* response = nullptr;  // the call's
  tandem::v1::WorkerResetPrefixCacheRequest request;
  std::vector<Target> targets;
  absl::Mutex mu;
  std::vector<grpc::Status> results ABSL_GUARDED_BY(mu);
  size_t pending ABSL_GUARDED_BY(mu) = 0;

  // Records target `i`'s end; the last one fills the response and finishes.
  void Done(size_t i, const grpc::Status& status) {
    {
      absl::MutexLock l(&mu);
      results[i] = status;
      if (--pending > 0) return;
    }
    for (size_t t = 0; t < targets.size(); ++t) {
      const grpc::Status& s = results[t];
      if (s.ok()) {
        response->add_reset(targets[t].worker_id);
        continue;
      }
      tandem::v1::ResetPrefixCacheFailure* f = response->add_failed();
      f->set_worker_id(targets[t].worker_id);
      f->set_role(targets[t].role);
      f->set_error(FromGrpcStatus(s).ToString());
    }
    reactor->Finish(grpc::Status::OK);
  }
};

}  // namespace

grpc::ServerUnaryReactor* RouterService::ResetPrefixCache(
    grpc::CallbackServerContext* context, const tandem::v1::ResetPrefixCacheRequest*,
    tandem::v1::ResetPrefixCacheResponse* response) {
  auto fan = std::make_shared<ResetFanOut>();
  fan->use = handoff_->UseChannels();
  fan->reactor = context->DefaultReactor();
  fan->response = response;
  std::vector<std::pair<tandem::v1::WorkerRole, std::string>> addresses;
  for (auto role : {tandem::v1::WORKER_ROLE_PREFILL, tandem::v1::WORKER_ROLE_DECODE}) {
    for (const WorkerRecord& w : registry_->Live(role)) {
      ResetFanOut::Target t;
      t.worker_id = w.registration.worker_id();
      t.role = role == tandem::v1::WORKER_ROLE_PREFILL ? "prefill" : "decode";
      fan->targets.push_back(std::move(t));
      addresses.emplace_back(role, w.registration.grpc_address());
    }
  }
  if (fan->targets.empty()) {
    fan->reactor->Finish(
        ToGrpcStatus(Unavailable("no live worker: no prefix cache to reset")));
    return fan->reactor;
  }
  const absl::Time deadline = std::min(rpc::ContextDeadline(*context),
                                       absl::Now() + options_.admin_rpc_timeout);
  {
    absl::MutexLock l(&fan->mu);
    fan->results.assign(fan->targets.size(), grpc::Status::OK);
    fan->pending = fan->targets.size();
  }
  for (size_t i = 0; i < fan->targets.size(); ++i) {
    ResetFanOut::Target& t = fan->targets[i];
    t.context = std::make_unique<grpc::ClientContext>();
    t.context->set_deadline(rpc::ToGrpcDeadline(deadline));
    auto done = [fan, i](grpc::Status s) { fan->Done(i, s); };
    const auto& [role, address] = addresses[i];
    if (role == tandem::v1::WORKER_ROLE_PREFILL) {
      handoff_->PrefillStub(address)->async()->ResetPrefixCache(
          t.context.get(), &fan->request, &t.response, std::move(done));
    } else {
      handoff_->DecodeStub(address)->async()->ResetPrefixCache(
          t.context.get(), &fan->request, &t.response, std::move(done));
    }
  }
  return fan->reactor;
}

RegistryService::RegistryService(WorkerRegistry* registry, RouterMetrics* metrics,
                                 std::string model_fingerprint,
                                 absl::Duration heartbeat_interval, Handoff* handoff)
    : registry_(registry),
      metrics_(metrics),
      model_fingerprint_(std::move(model_fingerprint)),
      heartbeat_interval_(heartbeat_interval),
      handoff_(handoff) {}

grpc::ServerUnaryReactor* RegistryService::Register(
    grpc::CallbackServerContext* context, const tandem::v1::RegisterRequest* request,
    tandem::v1::RegisterResponse* response) {
  absl::Status status;
  if (request->model_fingerprint() != model_fingerprint_) {
    status =
        FailedPrecondition("worker ", request->worker_id(),
                           " serves model fingerprint '", request->model_fingerprint(),
                           "' but this router serves '", model_fingerprint_, "'");
  } else {
    status = registry_->Register(*request);
  }
  const std::string role = tandem::v1::WorkerRole_Name(request->role());
  metrics_->registrations
      ->Add({{"role", role}, {"result", status.ok() ? "ok" : "rejected"}})
      .Increment();
  TLOG(INFO, "worker registration")
      .Kv("worker_id", request->worker_id())
      .Kv("role", role)
      .Kv("address", request->grpc_address())
      .Kv("status", status);
  if (status.ok()) {
    response->set_heartbeat_interval_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(heartbeat_interval_)));
    UpdateWorkerGauges();
    if (handoff_ != nullptr) {
      // The registration's snapshot replaces what the router knew of the
      // worker's cache (a first registration, or the resync it asked for).
      handoff_->prefill_router()->OnRegister(*request);
      handoff_->metrics()->prefix_events->Increment(request->prefix_snapshot_size());
      UpdatePrefixGauges();
    }
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::Heartbeat(
    grpc::CallbackServerContext* context, const tandem::v1::HeartbeatRequest* request,
    tandem::v1::HeartbeatResponse* response) {
  response->set_known(registry_->Heartbeat(request->worker_id(), request->load()));
  UpdateWorkerGauges();
  if (handoff_ != nullptr && response->known()) {
    const ReportOutcome r = handoff_->prefill_router()->OnHeartbeat(*request);
    response->set_prefix_acked_seq(r.acked_seq);
    response->set_resync_prefix_index(r.resync);
    handoff_->metrics()->prefix_events->Increment(static_cast<double>(r.applied));
    if (r.resync) {
      handoff_->metrics()->prefix_resyncs->Add({{"reason", r.why}}).Increment();
      TLOG(WARNING, "prefix index diverged from the worker's cache; asking a resync")
          .Kv("worker_id", request->worker_id())
          .Kv("reason", r.why)
          .Kv("epoch", request->prefix_epoch())
          .Kv("first_seq", request->prefix_first_seq())
          .Kv("acked_seq", r.acked_seq);
    }
    if (r.applied > 0) {
      // This worker's series only: heartbeats with events come every 50 ms
      // from every busy worker.
      handoff_->metrics()
          ->prefix_index_entries->Add({{"worker", request->worker_id()}})
          .Set(static_cast<double>(
              handoff_->prefill_router()->IndexSize(request->worker_id())));
    }
  }
  // A decode worker with free slots and blocks: that many queued requests retry.
  const tandem::v1::WorkerLoad& load = request->load();
  bool decode = false;
  for (const WorkerRecord& w : registry_->Live(tandem::v1::WORKER_ROLE_DECODE)) {
    decode = decode || w.registration.worker_id() == request->worker_id();
  }
  if (handoff_ != nullptr && decode &&
      (load.total_kv_blocks() == 0 || load.free_kv_blocks() > 0)) {
    const int slots = load.total_state_slots() > 0 ? load.free_state_slots() : 1;
    handoff_->CapacityMayHaveFreed(slots);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void RegistryService::UpdatePrefixGauges() {
  // Workers the registry dropped (expired, removed after failed RPCs) leave
  // the index (at each registration); their series read 0.
  absl::flat_hash_set<std::string> live;
  for (auto role : {tandem::v1::WORKER_ROLE_PREFILL, tandem::v1::WORKER_ROLE_DECODE}) {
    for (const WorkerRecord& w : registry_->Live(role)) {
      live.insert(w.registration.worker_id());
    }
  }
  PrefillRouter* router = handoff_->prefill_router();
  router->Retain(live);
  absl::MutexLock l(&gauge_mu_);
  absl::flat_hash_set<std::string> now;
  for (const auto& [id, n] : router->IndexSizes()) {
    handoff_->metrics()->prefix_index_entries->Add({{"worker", id}}).Set(n);
    now.insert(id);
  }
  for (const std::string& id : indexed_) {
    if (!now.contains(id))
      handoff_->metrics()->prefix_index_entries->Add({{"worker", id}}).Set(0);
  }
  indexed_ = std::move(now);
}

void RegistryService::UpdateWorkerGauges() {
  metrics_->workers->Add({{"role", "prefill"}})
      .Set(registry_->Live(tandem::v1::WORKER_ROLE_PREFILL).size());
  metrics_->workers->Add({{"role", "decode"}})
      .Set(registry_->Live(tandem::v1::WORKER_ROLE_DECODE).size());
}

}  // namespace tandem::router
