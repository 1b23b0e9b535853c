#include "router/handoff.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "metrics/buckets.h"

namespace tandem::router {
namespace {

using tandem::v1::GenerateResponse;

using metrics::OrDie;

std::chrono::system_clock::time_point Chrono(absl::Time t) {
  if (t == absl::InfiniteFuture()) return std::chrono::system_clock::time_point::max();
  return absl::ToChronoTime(t);
}

// One request's hand-off (handoff.h has the state map).
class GenerateCall : public std::enable_shared_from_this<GenerateCall> {
 public:
  GenerateCall(Handoff* h, tandem::v1::GenerateRequest request,
               rpc::ResponseSink* stream, absl::Time deadline, absl::Time started,
               std::function<void(const absl::Status&)> on_finish)
      : h_(h),
        req_(std::move(request)),
        stream_(stream),
        deadline_(deadline),
        started_(started),
        on_finish_(std::move(on_finish)) {
    prompt_tokens_ = req_.prompt_token_ids().ids_size();
  }

  void Start() {
    std::weak_ptr<GenerateCall> weak = shared_from_this();
    stream_->SetOnCancel([weak] {
      if (auto self = weak.lock()) self->Cancel();
    });
    const HandoffOptions& o = h_->options();
    const bool colocate =
        prompt_tokens_ < o.colocate_below_tokens || req_.stop().min_tokens() > 0 ||
        (o.max_context_tokens > 0 && prompt_tokens_ + 1 >= o.max_context_tokens) ||
        h_->registry()->Live(tandem::v1::WORKER_ROLE_PREFILL).empty();
    if (colocate) {
      Colocate();
    } else {
      Reserve();
    }
  }

  // Client went away (or its deadline passed).
  void Cancel() {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    if (active_ != nullptr) active_->TryCancel();
  }

  // Relayed stream events (RelayReactor).
  void OnMessage(GenerateResponse m) {
    m.set_request_id(req_.request_id());
    const absl::Time now = absl::Now();
    if (!first_sent_ && m.token_ids_size() > 0) {
      first_sent_ = true;
      first_at_ = now;
      h_->metrics()->ttft->Observe(absl::ToDoubleSeconds(now - started_));
    }
    if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
      tandem::v1::Usage* u = m.mutable_usage();
      u->set_prompt_tokens(prompt_tokens_);
      u->set_ttft_seconds(first_sent_ ? absl::ToDoubleSeconds(first_at_ - started_)
                                      : 0);
      u->set_total_seconds(absl::ToDoubleSeconds(now - started_));
    }
    stream_->Push(std::move(m));
  }

  void OnStreamDone(const grpc::Status& status, const WorkerRecord& worker) {
    ClearActive();
    h_->Unplace(worker.registration.worker_id(), req_.request_id());
    reserved_requests_ = 0;
    reserved_tokens_ = 0;
    if (status.ok()) return Finish(absl::OkStatus());
    absl::Status s = FromGrpcStatus(status);
    if (IsCancelled()) return Finish(absl::CancelledError("cancelled by the client"));
    if (absl::IsUnavailable(s)) {
      h_->registry()->Remove(worker.registration.worker_id());
      s = absl::UnavailableError(absl::StrCat(
          "decode worker ", worker.registration.worker_id(), " (",
          worker.registration.grpc_address(),
          ") failed or became unreachable during the request: ", s.message()));
    }
    Finish(s);
  }

 private:
  class RelayReactor;

  bool IsCancelled() {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }

  // Makes `ctx` the call a client cancel reaches (cancelling it at once when the
  // client is already gone).
  void SetActive(grpc::ClientContext* ctx) {
    ctx->set_deadline(Chrono(deadline_));
    absl::MutexLock l(&mu_);
    active_ = ctx;
    if (cancelled_) ctx->TryCancel();
  }
  void ClearActive() {
    absl::MutexLock l(&mu_);
    active_ = nullptr;
  }

  void Finish(const absl::Status& s) {
    if (finished_) return;
    finished_ = true;
    if (!s.ok()) {
      TLOG(INFO, "generate failed").Kv("request_id", req_.request_id()).Kv("status", s);
    }
    on_finish_(s);
    stream_->Close(ToGrpcStatus(s));
  }

  std::optional<WorkerRecord> PickDecode() {
    std::vector<WorkerRecord> live =
        h_->registry()->Live(tandem::v1::WORKER_ROLE_DECODE);
    auto i =
        SelectDecode(live, tried_decode_, h_->InFlightSnapshot(live), prompt_tokens_);
    if (!i.has_value()) return std::nullopt;
    return live[*i];
  }

  void NoDecodeWorker() {
    // A live decode worker that was not tried was skipped for lack of room: the
    // cluster is full, not down.
    bool skipped_full = false;
    for (const WorkerRecord& w : h_->registry()->Live(tandem::v1::WORKER_ROLE_DECODE)) {
      if (!tried_decode_.contains(w.registration.worker_id())) skipped_full = true;
    }
    if (decode_full_ || skipped_full) {
      return Finish(
          ResourceExhausted("every decode worker is full; retry later (prompt of ",
                            prompt_tokens_, " tokens)"));
    }
    Finish(absl::UnavailableError(
        absl::StrCat("no decode worker can take this request (prompt of ",
                     prompt_tokens_, " tokens); the request was not started")));
  }

  // COLOCATED: prefill + decode on one decode worker.
  void Colocate();

  // RESERVING
  void Reserve() {
    if (IsCancelled()) return Finish(absl::CancelledError("cancelled by the client"));
    std::optional<WorkerRecord> d = PickDecode();
    if (!d.has_value()) return NoDecodeWorker();
    decode_ = *d;
    auto self = shared_from_this();
    reserve_ctx_ = std::make_unique<grpc::ClientContext>();
    SetActive(reserve_ctx_.get());
    reserve_ctx_->set_deadline(
        Chrono(std::min(deadline_, absl::Now() + h_->options().rpc_timeout)));
    reserve_req_.set_request_id(req_.request_id());
    reserve_req_.set_prompt_tokens(prompt_tokens_);
    reserve_req_.set_max_new_tokens(req_.stop().max_tokens());
    // The registry admits only workers whose TP size equals every live worker's
    // of the other role, so the prefill worker picked next has the decode's size.
    reserve_req_.set_prefill_tp_size(std::max(decode_.registration.tp_size(), 1));
    reserve_req_.set_lease_ms(h_->options().lease_ms);
    target_.Clear();
    h_->DecodeStub(decode_.registration.grpc_address())
        ->async()
        ->Reserve(reserve_ctx_.get(), &reserve_req_, &target_,
                  [self](grpc::Status s) { self->OnReserved(s); });
  }

  void OnReserved(const grpc::Status& status) {
    ClearActive();
    const std::string& id = decode_.registration.worker_id();
    if (status.ok()) {
      reserved_requests_ = 1;
      reserved_tokens_ = prompt_tokens_;
      h_->Place(decode_, req_.request_id(), prompt_tokens_);
      if (IsCancelled()) {
        ReleaseReservation();
        return Finish(absl::CancelledError("cancelled by the client"));
      }
      return Prefill();
    }
    if (IsCancelled()) return Finish(absl::CancelledError("cancelled by the client"));
    tried_decode_.insert(id);
    switch (status.error_code()) {
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        decode_full_ = true;
        h_->metrics()->retries->Add({{"reason", "decode_full"}}).Increment();
        return Reserve();
      case grpc::StatusCode::UNAVAILABLE:
        h_->registry()->Remove(id);
        h_->metrics()->retries->Add({{"reason", "decode_unavailable"}}).Increment();
        return Reserve();
      default:
        return Finish(FromGrpcStatus(status));
    }
  }

  // RELEASING (fire and forget, bounded).
  // Frees the reservation on the decode worker. `then`, when given, runs once the
  // Release RPC has ended (either way): a retry that reserves again for the same
  // request id must not race its own Release.
  void ReleaseReservation(std::function<void()> then = nullptr) {
    h_->Unplace(decode_.registration.worker_id(), req_.request_id());
    reserved_requests_ = 0;
    reserved_tokens_ = 0;
    struct Release {
      grpc::ClientContext ctx;
      tandem::v1::ReleaseRequest req;
      tandem::v1::ReleaseResponse resp;
    };
    auto r = std::make_shared<Release>();
    r->ctx.set_deadline(Chrono(absl::Now() + h_->options().rpc_timeout));
    r->req.set_request_id(req_.request_id());
    const std::string rid = req_.request_id();
    h_->DecodeStub(decode_.registration.grpc_address())
        ->async()
        ->Release(&r->ctx, &r->req, &r->resp, [r, rid, then](grpc::Status s) {
          if (!s.ok()) {
            TLOG(INFO, "release failed (the lease frees it)")
                .Kv("request_id", rid)
                .Kv("status", s.error_message());
          }
          if (then) then();
        });
  }

  // PREFILLING
  void Prefill() {
    std::vector<WorkerRecord> live =
        h_->registry()->Live(tandem::v1::WORKER_ROLE_PREFILL);
    auto i = SelectPrefill(live, tried_prefill_, h_->InFlightSnapshot(live));
    if (!i.has_value()) {
      // No prefill worker left: prefill on the decode worker instead, once the
      // reservation made for this request id is gone.
      h_->metrics()->retries->Add({{"reason", "colocated_fallback"}}).Increment();
      TLOG(INFO, "no prefill worker available; prefilling on a decode worker")
          .Kv("request_id", req_.request_id());
      tried_decode_.clear();
      auto self = shared_from_this();
      return ReleaseReservation([self] { self->Colocate(); });
    }
    prefill_ = live[*i];
    ++prefill_attempts_;
    auto self = shared_from_this();
    prefill_ctx_ = std::make_unique<grpc::ClientContext>();
    SetActive(prefill_ctx_.get());
    prefill_req_.Clear();
    prefill_req_.set_request_id(req_.request_id());
    *prefill_req_.mutable_prompt_token_ids() = req_.prompt_token_ids().ids();
    *prefill_req_.mutable_sampling() = req_.sampling();
    *prefill_req_.mutable_target() = target_;
    if (deadline_ != absl::InfiniteFuture()) {
      prefill_req_.set_deadline_unix_ms(absl::ToUnixMillis(deadline_));
    }
    prefill_req_.set_checksums(h_->options().checksums);
    prefill_resp_.Clear();
    h_->Place(prefill_, req_.request_id(), prompt_tokens_);
    h_->PrefillStub(prefill_.registration.grpc_address())
        ->async()
        ->Prefill(prefill_ctx_.get(), &prefill_req_, &prefill_resp_,
                  [self](grpc::Status s) { self->OnPrefilled(s); });
  }

  void OnPrefilled(const grpc::Status& status) {
    ClearActive();
    const std::string& pid = prefill_.registration.worker_id();
    h_->Unplace(pid, req_.request_id());
    if (status.ok()) {
      h_->metrics()->transfer_seconds->Observe(prefill_resp_.transfer().seconds());
      if (IsCancelled()) {
        ReleaseReservation();
        return Finish(absl::CancelledError("cancelled by the client"));
      }
      return Decode();
    }
    if (IsCancelled()) {
      ReleaseReservation();
      return Finish(absl::CancelledError("cancelled by the client"));
    }
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // The prefill worker (or its transfer) is gone: try another one.
      TLOG(WARNING, "prefill worker lost before the hand-off; retrying")
          .Kv("request_id", req_.request_id())
          .Kv("worker_id", pid)
          .Kv("status", status.error_message());
      h_->registry()->Remove(pid);
      tried_prefill_.insert(pid);
      h_->metrics()->retries->Add({{"reason", "prefill_unavailable"}}).Increment();
      if (prefill_attempts_ < h_->options().max_prefill_attempts) {
        tried_decode_.clear();
        auto self = shared_from_this();
        return ReleaseReservation([self] { self->Reserve(); });
      }
      ReleaseReservation();
      return Finish(absl::UnavailableError(
          absl::StrCat("prefill failed on ", prefill_attempts_, " workers; last (", pid,
                       "): ", status.error_message())));
    }
    ReleaseReservation();
    Finish(FromGrpcStatus(status));
  }

  // DECODING
  void Decode();

  Handoff* const h_;  // not owned
  const tandem::v1::GenerateRequest req_;
  rpc::ResponseSink* const stream_;  // producer reference; Close()d in Finish
  const absl::Time deadline_;
  const absl::Time started_;
  std::function<void(const absl::Status&)> on_finish_;
  int32_t prompt_tokens_ = 0;

  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;

  // Touched by one callback at a time (the chain is sequential).
  bool finished_ = false;
  bool first_sent_ = false;
  absl::Time first_at_;
  bool decode_full_ = false;
  int prefill_attempts_ = 0;
  int32_t reserved_requests_ = 0;
  int64_t reserved_tokens_ = 0;
  absl::flat_hash_set<std::string> tried_decode_, tried_prefill_;
  WorkerRecord decode_, prefill_;
  std::unique_ptr<grpc::ClientContext> reserve_ctx_, prefill_ctx_;
  tandem::v1::ReserveRequest reserve_req_;
  tandem::v1::KvTarget target_;
  tandem::v1::PrefillRequest prefill_req_;
  tandem::v1::PrefillResponse prefill_resp_;
};

// Relays a worker's response stream (Decode or Generate) into the call.
class GenerateCall::RelayReactor final
    : public grpc::ClientReadReactor<GenerateResponse> {
 public:
  RelayReactor(std::shared_ptr<GenerateCall> call, WorkerRecord worker)
      : call_(std::move(call)), worker_(std::move(worker)) {}

  void StartDecode(tandem::v1::DecodeWorker::StubInterface* stub,
                   tandem::v1::DecodeRequest req) {
    decode_req_ = std::move(req);
    call_->SetActive(&ctx_);
    stub->async()->Decode(&ctx_, &decode_req_, this);
    Begin();
  }
  void StartGenerate(tandem::v1::DecodeWorker::StubInterface* stub,
                     const tandem::v1::GenerateRequest& req) {
    generate_req_ = req;
    call_->SetActive(&ctx_);
    stub->async()->Generate(&ctx_, &generate_req_, this);
    Begin();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows with the status
    call_->OnMessage(std::move(msg_));
    msg_.Clear();
    StartRead(&msg_);
  }
  void OnDone(const grpc::Status& status) override {
    call_->OnStreamDone(status, worker_);
    delete this;
  }

 private:
  void Begin() {
    StartRead(&msg_);
    StartCall();
  }

  std::shared_ptr<GenerateCall> call_;
  const WorkerRecord worker_;
  grpc::ClientContext ctx_;
  tandem::v1::DecodeRequest decode_req_;
  tandem::v1::GenerateRequest generate_req_;
  GenerateResponse msg_;
};

// COLOCATED: prefill + decode on one decode worker.
void GenerateCall::Colocate() {
  std::optional<WorkerRecord> d = PickDecode();
  if (!d.has_value()) return NoDecodeWorker();
  h_->metrics()->paths->Add({{"path", "colocated"}}).Increment();
  decode_ = *d;
  auto* relay = new RelayReactor(shared_from_this(), decode_);
  relay->StartGenerate(h_->DecodeStub(decode_.registration.grpc_address()), req_);
}

// DECODING
void GenerateCall::Decode() {
  h_->metrics()->paths->Add({{"path", "disaggregated"}}).Increment();
  tandem::v1::DecodeRequest dr;
  dr.set_request_id(req_.request_id());
  *dr.mutable_prompt_token_ids() = req_.prompt_token_ids().ids();
  dr.set_first_token_id(prefill_resp_.first_token_id());
  if (prefill_resp_.has_first_logprob()) {
    *dr.mutable_first_logprob() = prefill_resp_.first_logprob();
  }
  *dr.mutable_sampling() = req_.sampling();
  if (prefill_resp_.seed() != 0 || req_.sampling().has_seed()) {
    dr.mutable_sampling()->set_seed(prefill_resp_.seed());
  }
  *dr.mutable_stop() = req_.stop();
  if (prefill_resp_.has_checksums())
    *dr.mutable_checksums() = prefill_resp_.checksums();
  if (deadline_ != absl::InfiniteFuture()) {
    dr.set_deadline_unix_ms(absl::ToUnixMillis(deadline_));
  }
  dr.set_return_text(req_.return_text());
  auto* relay = new RelayReactor(shared_from_this(), decode_);
  relay->StartDecode(h_->DecodeStub(decode_.registration.grpc_address()),
                     std::move(dr));
}

}  // namespace

HandoffMetrics::HandoffMetrics(metrics::Registry* r) {
  const std::vector<double> buckets = *metrics::ExponentialBuckets(0.0005, 2, 18);
  retries =
      OrDie(r->AddCounter("tandem_router_retries_total",
                          "Hand-off retries by reason (prefill_unavailable, "
                          "decode_full, decode_unavailable, colocated_fallback)."));
  paths = OrDie(r->AddCounter("tandem_router_paths_total",
                              "Requests by path (disaggregated, colocated)."));
  ttft = &OrDie(r->AddHistogram("tandem_router_time_to_first_token_seconds",
                                "From Generate arrival to the first token relayed.",
                                buckets))
              ->Add({});
  latency =
      &OrDie(r->AddHistogram("tandem_router_request_duration_seconds",
                             "End-to-end Generate latency (every outcome).", buckets))
           ->Add({});
  transfer_seconds =
      &OrDie(r->AddHistogram("tandem_router_transfer_seconds",
                             "KV/state transfer time reported by prefill.", buckets))
           ->Add({});
  for (const char* reason : {"prefill_unavailable", "decode_full", "decode_unavailable",
                             "colocated_fallback"}) {
    retries->Add({{"reason", reason}});
  }
  for (const char* p : {"disaggregated", "colocated"}) paths->Add({{"path", p}});
}

Handoff::Handoff(WorkerRegistry* registry, HandoffMetrics* metrics,
                 HandoffOptions options)
    : registry_(registry), metrics_(metrics), options_(std::move(options)) {}

void Handoff::Start(tandem::v1::GenerateRequest request, rpc::ResponseSink* stream,
                    absl::Time deadline, absl::Time started,
                    std::function<void(const absl::Status&)> on_finish) {
  auto call = std::make_shared<GenerateCall>(this, std::move(request), stream, deadline,
                                             started, std::move(on_finish));
  call->Start();
}

tandem::v1::PrefillWorker::StubInterface* Handoff::PrefillStub(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  auto& stub = prefill_stubs_[address];
  if (stub == nullptr) {
    auto& ch = channels_[address];
    if (ch == nullptr)
      ch = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    stub = tandem::v1::PrefillWorker::NewStub(ch);
  }
  return stub.get();
}

tandem::v1::DecodeWorker::StubInterface* Handoff::DecodeStub(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  auto& stub = decode_stubs_[address];
  if (stub == nullptr) {
    auto& ch = channels_[address];
    if (ch == nullptr)
      ch = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    stub = tandem::v1::DecodeWorker::NewStub(ch);
  }
  return stub.get();
}

InFlightMap Handoff::InFlightSnapshot(const std::vector<WorkerRecord>& live) {
  absl::MutexLock l(&mu_);
  InFlightMap out;
  for (const WorkerRecord& w : live) {
    auto it = placements_.find(w.registration.worker_id());
    if (it == placements_.end()) continue;
    // Placements a newer report already covers are dropped here for good.
    auto& v = it->second;
    v.erase(std::remove_if(
                v.begin(), v.end(),
                [&](const Placement& p) { return p.reports_at_placement < w.reports; }),
            v.end());
    InFlight f;
    for (const Placement& p : v) {
      f.requests += 1;
      f.tokens += p.tokens;
    }
    if (f.requests > 0) out[w.registration.worker_id()] = f;
  }
  return out;
}

void Handoff::Place(const WorkerRecord& worker, const std::string& request_id,
                    int64_t tokens) {
  absl::MutexLock l(&mu_);
  placements_[worker.registration.worker_id()].push_back(
      Placement{request_id, worker.reports, tokens});
}

void Handoff::Unplace(const std::string& worker_id, const std::string& request_id) {
  absl::MutexLock l(&mu_);
  auto it = placements_.find(worker_id);
  if (it == placements_.end()) return;
  auto& v = it->second;
  auto p = std::find_if(v.begin(), v.end(),
                        [&](const Placement& x) { return x.request_id == request_id; });
  if (p != v.end()) v.erase(p);
  if (v.empty()) placements_.erase(it);
}

}  // namespace tandem::router
