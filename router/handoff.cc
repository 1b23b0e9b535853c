#include "router/handoff.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/grpc_status.h"
#include "common/logging.h"
#include "rpc/deadline.h"

namespace tandem::router {
namespace {

using tandem::v1::GenerateResponse;
using Kind = Placement::Action::Kind;

// One request's hand-off: runs its Placement's actions as gRPC calls and feeds
// their ends back as events (handoff.h has the flow, placement.h the states).
class HandoffCall : public std::enable_shared_from_this<HandoffCall> {
 public:
  HandoffCall(Handoff* h, tandem::v1::GenerateRequest request,
              rpc::ResponseSink* stream, absl::Time deadline, absl::Time started,
              std::function<void(const absl::Status&)> on_finish)
      : use_(h->UseChannels()),
        h_(h),
        req_(std::move(request)),
        stream_(stream),
        started_(started),
        deadline_(deadline),
        on_finish_(std::move(on_finish)),
        placement_(h->deps(), h->options(),
                   PlacementRequest{
                       .request_id = req_.request_id(),
                       .prompt_tokens = req_.prompt_token_ids().ids_size(),
                       .min_tokens = static_cast<int32_t>(req_.stop().min_tokens()),
                       .deadline = deadline,
                       .started = started,
                       // Every policy: the conditional disaggregation
                       // matches them against the decode workers' reports.
                       // With the images' hashes, as the engine's.
                       .prefix_hashes = RouterBlockHashes(req_),
                       .has_images = req_.images_size() > 0,
                   }) {}

  void Start() {
    std::weak_ptr<HandoffCall> weak = shared_from_this();
    stream_->SetOnCancel([weak] {
      if (auto self = weak.lock()) self->Step([](Placement& p) { return p.Cancel(); });
    });
    Step([](Placement& p) { return p.Start(); });
  }

 private:
  class RelayReactor;

  // Feeds one event to the placement and runs the actions it returns. The
  // call in flight is cancelled under the lock (it is the one `active_` names).
  template <typename Event>
  void Step(Event event) {
    Placement::Actions actions;
    {
      absl::MutexLock l(&mu_);
      actions = event(placement_);
      for (const Placement::Action& a : actions) {
        if (a.kind == Kind::kCancelCall && active_ != nullptr) active_->TryCancel();
      }
    }
    for (Placement::Action& a : actions) Run(std::move(a));
  }

  void Run(Placement::Action a) {
    switch (a.kind) {
      case Kind::kReserve:
        return Reserve(a);
      case Kind::kPrefill:
        return Prefill(a);
      case Kind::kRelease:
        return Release(a);
      case Kind::kDecode:
        return Decode(a);
      case Kind::kColocate:
        return Colocate(a);
      case Kind::kCancelCall:
        return;  // done in Step
      case Kind::kQueue:
        return Queue(a);
      case Kind::kDequeue:
        return Dequeue();
      case Kind::kFinish:
        return Finish(a.status);
    }
  }

  // Makes `ctx` the call a client cancel reaches (cancelling it at once when the
  // client is already gone).
  void SetActive(grpc::ClientContext* ctx, absl::Time deadline) {
    ctx->set_deadline(rpc::ToGrpcDeadline(deadline));
    absl::MutexLock l(&mu_);
    active_ = ctx;
    if (placement_.cancelled()) ctx->TryCancel();
  }
  void ClearActive() {
    absl::MutexLock l(&mu_);
    active_ = nullptr;
  }

  void Reserve(const Placement::Action& a) {
    auto self = shared_from_this();
    reserve_ctx_ = std::make_unique<grpc::ClientContext>();
    SetActive(reserve_ctx_.get(), a.deadline);
    reserve_req_.set_request_id(req_.request_id());
    reserve_req_.set_prompt_tokens(req_.prompt_token_ids().ids_size());
    reserve_req_.set_max_new_tokens(req_.stop().max_tokens());
    // The registry admits only workers whose TP size equals every live worker's
    // of the other role, so the prefill worker picked next has the decode's size.
    reserve_req_.set_prefill_tp_size(std::max(a.worker.registration.tp_size(), 1));
    reserve_req_.set_lease_ms(
        ReservationLeaseMs(deadline_, h_->clock()->Now(), h_->options().lease_ms));
    // A decode-side prefix hit: the worker shares what its cache holds of this
    // prompt, and the prefill worker writes only the rest. Only when the
    // placement chose to (a prefill worker that writes after held rows
    // available; for a prompt with images, a decode worker that reads their
    // spans): without the ids a decode worker that predates
    // share_held_prefix shares nothing either.
    reserve_req_.clear_prompt_token_ids();
    reserve_req_.clear_cache_salt();
    reserve_req_.clear_images();
    reserve_req_.set_share_held_prefix(a.share_held_prefix);
    if (a.share_held_prefix) {
      *reserve_req_.mutable_prompt_token_ids() = req_.prompt_token_ids().ids();
      reserve_req_.set_cache_salt(req_.cache_salt());
    }
    if (a.send_images) {  // spans and hashes only: the bytes go to prefill
      for (const tandem::v1::ImageInput& im : req_.images()) {
        tandem::v1::ImageInput* span = reserve_req_.add_images();
        span->set_placeholder_start(im.placeholder_start());
        span->set_num_tokens(im.num_tokens());
        span->set_content_hash(im.content_hash());
      }
    }
    target_.Clear();
    h_->DecodeStub(a.worker.registration.grpc_address())
        ->async()
        ->Reserve(reserve_ctx_.get(), &reserve_req_, &target_, [self](grpc::Status s) {
          self->ClearActive();
          self->Step([&](Placement& p) {
            return p.OnReserved(FromGrpcStatus(s),
                                s.ok() ? self->target_.cached_prefix_tokens() : 0);
          });
        });
  }

  void Prefill(const Placement::Action& a) {
    auto self = shared_from_this();
    prefill_ctx_ = std::make_unique<grpc::ClientContext>();
    SetActive(prefill_ctx_.get(), a.deadline);
    prefill_req_.Clear();
    prefill_req_.set_request_id(req_.request_id());
    *prefill_req_.mutable_prompt_token_ids() = req_.prompt_token_ids().ids();
    *prefill_req_.mutable_sampling() = req_.sampling();
    *prefill_req_.mutable_target() = target_;
    prefill_req_.set_deadline_unix_ms(rpc::ToUnixMillisOrZero(a.deadline));
    prefill_req_.set_checksums(h_->options().checksums);
    prefill_req_.set_cache_salt(req_.cache_salt());
    *prefill_req_.mutable_images() = req_.images();
    prefill_resp_.Clear();
    h_->PrefillStub(a.worker.registration.grpc_address())
        ->async()
        ->Prefill(prefill_ctx_.get(), &prefill_req_, &prefill_resp_,
                  [self](grpc::Status s) {
                    self->ClearActive();
                    if (s.ok()) {
                      self->h_->metrics()->transfer_seconds->Observe(
                          self->prefill_resp_.transfer().seconds());
                    }
                    self->Step(
                        [&](Placement& p) { return p.OnPrefilled(FromGrpcStatus(s)); });
                  });
  }

  // Frees the reservation on the decode worker (bounded by rpc_timeout). An
  // awaited Release feeds OnReleased: a retry that reserves again for the same
  // request id must not race its own Release.
  void Release(const Placement::Action& a) {
    struct Call {
      rpc::ChannelUsers::Use use;  // first: outlives ctx
      grpc::ClientContext ctx;
      tandem::v1::ReleaseRequest req;
      tandem::v1::ReleaseResponse resp;
    };
    auto r = std::make_shared<Call>();
    r->use = h_->UseChannels();
    r->ctx.set_deadline(rpc::ToGrpcDeadline(a.deadline));
    r->req.set_request_id(req_.request_id());
    std::shared_ptr<HandoffCall> self;
    if (a.await) self = shared_from_this();
    h_->DecodeStub(a.worker.registration.grpc_address())
        ->async()
        ->Release(&r->ctx, &r->req, &r->resp,
                  [r, self, rid = req_.request_id()](grpc::Status s) {
                    if (!s.ok()) {
                      TLOG(INFO, "release failed (the lease frees it)")
                          .Kv("request_id", rid)
                          .Kv("status", s.error_message());
                    }
                    if (self != nullptr) {
                      self->Step([&](Placement& p) {
                        return p.OnReleased(FromGrpcStatus(s));
                      });
                    }
                  });
  }

  void Decode(const Placement::Action& a);
  void Colocate(const Placement::Action& a);

  // QUEUED: waits in the decode lane (keeping its place across waits).
  void Queue(const Placement::Action& a) {
    auto self = shared_from_this();
    absl::StatusOr<uint64_t> ticket =
        h_->queue()->Push(AdmissionQueue::Lane::kDecode, req_.priority(), a.deadline,
                          &place_, [self](const absl::Status& s) {
                            self->Step([&](Placement& p) { return p.OnQueueEnd(s); });
                          });
    if (!ticket.ok()) {
      Step([&](Placement& p) { return p.OnQueueEnd(ticket.status()); });
      return;
    }
    bool left;
    {
      absl::MutexLock l(&mu_);
      ticket_ = *ticket;
      // A cancel between the Push and now found no ticket to remove.
      left = placement_.state() == Placement::State::kFinished;
    }
    if (left) h_->queue()->Remove(*ticket);
  }
  void Dequeue() {
    uint64_t ticket;
    {
      absl::MutexLock l(&mu_);
      ticket = ticket_;
    }
    if (ticket != 0) h_->queue()->Remove(ticket);
  }

  // Relayed stream events (RelayReactor), one relay at a time.
  void OnMessage(GenerateResponse m) {
    m.set_request_id(req_.request_id());
    const absl::Time now = h_->clock()->Now();
    if (!first_sent_ && m.token_ids_size() > 0) {
      first_sent_ = true;
      first_at_ = now;
      h_->metrics()->ttft->Observe(absl::ToDoubleSeconds(now - started_));
    }
    if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
      tandem::v1::Usage* u = m.mutable_usage();
      u->set_prompt_tokens(req_.prompt_token_ids().ids_size());
      // Disaggregated: the prefill worker's cache hit (the decode worker
      // computed no prompt); colocated: the decode worker's own.
      u->set_cached_prompt_tokens(
          std::max(u->cached_prompt_tokens(), prefill_resp_.cached_prompt_tokens()));
      u->set_ttft_seconds(first_sent_ ? absl::ToDoubleSeconds(first_at_ - started_)
                                      : 0);
      u->set_total_seconds(absl::ToDoubleSeconds(now - started_));
    }
    stream_->Push(std::move(m));
  }
  void OnStreamDone(const grpc::Status& status) {
    ClearActive();
    Step([&](Placement& p) { return p.OnStreamDone(FromGrpcStatus(status)); });
  }

  void Finish(const absl::Status& s) {
    if (!s.ok()) {
      TLOG(INFO, "generate failed").Kv("request_id", req_.request_id()).Kv("status", s);
    }
    on_finish_(s);
    stream_->Close(ToGrpcStatus(s));
  }

  // First: destroyed after the contexts (theirs and the relays', which hold
  // this call) drop their channel references.
  rpc::ChannelUsers::Use use_;
  Handoff* const h_;  // not owned
  const tandem::v1::GenerateRequest req_;
  rpc::ResponseSink* const stream_;  // producer reference; Close()d in Finish
  const absl::Time started_;
  const absl::Time deadline_;  // the request's
  const std::function<void(const absl::Status&)> on_finish_;

  absl::Mutex mu_;
  Placement placement_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // in the queue (QUEUED)
  QueuePlace place_;                          // kept across waits

  // Touched by one call's callbacks at a time (the calls are sequential).
  bool first_sent_ = false;
  absl::Time first_at_;
  std::unique_ptr<grpc::ClientContext> reserve_ctx_, prefill_ctx_;
  tandem::v1::ReserveRequest reserve_req_;
  tandem::v1::KvTarget target_;
  tandem::v1::PrefillRequest prefill_req_;
  tandem::v1::PrefillResponse prefill_resp_;
};

// Relays a worker's response stream (Decode or Generate) into the call.
class HandoffCall::RelayReactor final
    : public grpc::ClientReadReactor<GenerateResponse> {
 public:
  explicit RelayReactor(std::shared_ptr<HandoffCall> call) : call_(std::move(call)) {}

  void StartDecode(tandem::v1::DecodeWorker::StubInterface* stub,
                   tandem::v1::DecodeRequest req, absl::Time deadline) {
    decode_req_ = std::move(req);
    call_->SetActive(&ctx_, deadline);
    stub->async()->Decode(&ctx_, &decode_req_, this);
    Begin();
  }
  void StartGenerate(tandem::v1::DecodeWorker::StubInterface* stub,
                     const tandem::v1::GenerateRequest& req, absl::Time deadline) {
    generate_req_ = req;
    call_->SetActive(&ctx_, deadline);
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
    call_->OnStreamDone(status);
    delete this;
  }

 private:
  void Begin() {
    StartRead(&msg_);
    StartCall();
  }

  std::shared_ptr<HandoffCall> call_;
  grpc::ClientContext ctx_;
  tandem::v1::DecodeRequest decode_req_;
  tandem::v1::GenerateRequest generate_req_;
  GenerateResponse msg_;
};

// COLOCATED: prefill + decode on one decode worker.
void HandoffCall::Colocate(const Placement::Action& a) {
  auto* relay = new RelayReactor(shared_from_this());
  relay->StartGenerate(h_->DecodeStub(a.worker.registration.grpc_address()), req_,
                       a.deadline);
}

// DECODING: the first token and the seed come from Prefill.
void HandoffCall::Decode(const Placement::Action& a) {
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
  dr.set_cacheable_prompt_tokens(prefill_resp_.aligned_prompt_tokens());
  *dr.mutable_prompt_logprobs() = prefill_resp_.prompt_logprobs();
  dr.set_deadline_unix_ms(rpc::ToUnixMillisOrZero(a.deadline));
  dr.set_return_text(req_.return_text());
  auto* relay = new RelayReactor(shared_from_this());
  relay->StartDecode(h_->DecodeStub(a.worker.registration.grpc_address()),
                     std::move(dr), a.deadline);
}

}  // namespace

Handoff::Handoff(WorkerRegistry* registry, HandoffMetrics* metrics,
                 HandoffOptions options, Clock* clock)
    : registry_(registry),
      metrics_(metrics),
      options_(std::move(options)),
      clock_(clock),
      prefill_router_(options_.routing_policy, options_.cache_aware, clock),
      queue_(clock, &metrics->queue, options_.queue) {
  ticker_ = std::thread([this] {
    absl::MutexLock l(&tick_mu_);
    while (
        !tick_mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20))) {
      tick_mu_.Unlock();
      queue_.Expire();
      // A decode worker can vanish without a last word (hung, partitioned: its
      // heartbeats stop and the registry drops it). Waiters for decode room are
      // then woken to find no worker and end UNAVAILABLE at once, rather than
      // wait out the queue timeout for capacity that cannot come.
      if (registry_->Live(tandem::v1::WORKER_ROLE_DECODE).empty()) {
        queue_.Wake(AdmissionQueue::Lane::kDecode, std::numeric_limits<int>::max());
      }
      tick_mu_.Lock();
    }
  });
}

Handoff::~Handoff() {
  // First, while the ticker still expires queued calls.
  if (!gave_up_.load(std::memory_order_relaxed)) WaitCallsEnded(kCallsEndWithin);
  {
    absl::MutexLock l(&tick_mu_);
    stop_ = true;
  }
  ticker_.join();
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  {
    absl::MutexLock l(&mu_);
    for (auto& [address, channel] : channels_) channels.push_back(std::move(channel));
    channels_.clear();
    prefill_stubs_.clear();
    decode_stubs_.clear();
  }
  channel_users_.ReleaseChannels(std::move(channels), absl::ZeroDuration(),
                                 "router hand-off");
}

void Handoff::CapacityMayHaveFreed(int decode_slots) {
  if (decode_slots > 0) queue_.Wake(AdmissionQueue::Lane::kDecode, decode_slots);
}

void Handoff::Start(tandem::v1::GenerateRequest request, rpc::ResponseSink* stream,
                    absl::Time deadline, absl::Time started,
                    std::function<void(const absl::Status&)> on_finish) {
  auto call = std::make_shared<HandoffCall>(this, std::move(request), stream, deadline,
                                            started, std::move(on_finish));
  call->Start();
}

void Handoff::SetWorkerCredentials(
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  absl::MutexLock l(&mu_);
  worker_credentials_ = std::move(credentials);
}

std::shared_ptr<grpc::Channel> Handoff::ChannelLocked(const std::string& address) {
  auto& ch = channels_[address];
  if (ch == nullptr) ch = grpc::CreateChannel(address, worker_credentials_);
  return ch;
}

tandem::v1::PrefillWorker::StubInterface* Handoff::PrefillStub(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  auto& stub = prefill_stubs_[address];
  if (stub == nullptr)
    stub = tandem::v1::PrefillWorker::NewStub(ChannelLocked(address));
  return stub.get();
}

tandem::v1::DecodeWorker::StubInterface* Handoff::DecodeStub(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  auto& stub = decode_stubs_[address];
  if (stub == nullptr) stub = tandem::v1::DecodeWorker::NewStub(ChannelLocked(address));
  return stub.get();
}

}  // namespace tandem::router
