#include "worker/registration.h"

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/time/clock.h"
#include "common/logging.h"

namespace tandem::worker {
namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

}  // namespace

RegistrationClient::RegistrationClient(
    std::string router_address, tandem::v1::RegisterRequest request,
    std::function<tandem::v1::WorkerLoad()> load, absl::Duration rpc_timeout,
    std::function<void(const std::string&)> on_refused,
    std::function<absl::Status()> health,
    std::shared_ptr<grpc::ChannelCredentials> credentials,
    PrefixEventSource prefix_events)
    : request_(std::move(request)),
      load_(std::move(load)),
      rpc_timeout_(rpc_timeout),
      on_refused_(std::move(on_refused)),
      health_(std::move(health)),
      prefix_events_(std::move(prefix_events)) {
  if (prefix_events_)
    prefix_log_ = std::make_unique<PrefixEventLog>(RandomPrefixEpoch());
  stub_ = tandem::v1::Registry::NewStub(
      grpc::CreateChannel(router_address, std::move(credentials)));
  thread_ = std::thread([this] { Run(); });
}

RegistrationClient::~RegistrationClient() { Stop(); }

void RegistrationClient::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    registered_ = false;
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

void RegistrationClient::Nudge() {
  absl::MutexLock l(&mu_);
  nudged_ = true;
}

bool RegistrationClient::registered() const {
  absl::MutexLock l(&mu_);
  return registered_;
}

int64_t RegistrationClient::registrations() const {
  absl::MutexLock l(&mu_);
  return registrations_;
}

int64_t RegistrationClient::heartbeats() const {
  absl::MutexLock l(&mu_);
  return heartbeats_;
}

void RegistrationClient::DrainPrefixEvents() {
  if (prefix_log_ != nullptr) prefix_log_->Add(prefix_events_());
}

void RegistrationClient::Run() {
  absl::Duration interval = absl::Milliseconds(200);  // until the router says
  bool registered = false;
  absl::Time last_warning = absl::InfinitePast();
  bool settle = false;    // the last heartbeat carried prefix events
  std::string last_load;  // the load it carried (serialized)
  while (true) {
    if (health_) {
      if (absl::Status h = health_(); !h.ok()) {
        TLOG(WARNING, "worker unhealthy: no more registration or heartbeats")
            .Kv("worker_id", request_.worker_id())
            .Kv("status", h);
        absl::MutexLock l(&mu_);
        registered_ = false;
        return;
      }
    }
    DrainPrefixEvents();
    // Too much unacknowledged (the router away for long): a snapshot instead.
    if (prefix_log_ != nullptr && prefix_log_->needs_register()) registered = false;
    if (!registered) {
      tandem::v1::RegisterRequest req = request_;
      *req.mutable_load() = load_();
      if (prefix_log_ != nullptr) prefix_log_->FillRegister(&req);
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(rpc_timeout_));
      tandem::v1::RegisterResponse resp;
      grpc::Status s = stub_->Register(&ctx, req, &resp);
      if (s.ok()) {
        registered = true;
        if (resp.heartbeat_interval_ms() > 0) {
          interval = absl::Milliseconds(resp.heartbeat_interval_ms());
        }
        TLOG(INFO, "registered with the router")
            .Kv("worker_id", request_.worker_id())
            .Kv("heartbeat_ms", absl::ToInt64Milliseconds(interval));
      } else if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
                 on_refused_) {
        TLOG(ERROR, "the router refused this worker")
            .Kv("worker_id", request_.worker_id())
            .Kv("status", s.error_message());
        on_refused_(s.error_message());
        return;
      } else {
        // Shown (a router not up yet, a refused TLS handshake): the first
        // failure, then one every 10 s.
        const bool warn = absl::Now() - last_warning >= absl::Seconds(10);
        if (warn) last_warning = absl::Now();
        if (warn) {
          TLOG(WARNING, "cannot register with the router; retrying")
              .Kv("worker_id", request_.worker_id())
              .Kv("code", static_cast<int>(s.error_code()))
              .Kv("status", s.error_message());
        } else {
          TLOG(DEBUG, "registration failed; retrying")
              .Kv("worker_id", request_.worker_id())
              .Kv("status", s.error_message());
        }
      }
      absl::MutexLock l(&mu_);
      registered_ = registered;
      if (registered) ++registrations_;
    } else {
      tandem::v1::HeartbeatRequest req;
      req.set_worker_id(request_.worker_id());
      *req.mutable_load() = load_();
      if (prefix_log_ != nullptr) prefix_log_->FillHeartbeat(&req);
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(rpc_timeout_));
      tandem::v1::HeartbeatResponse resp;
      grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
      {
        absl::MutexLock l(&mu_);
        ++heartbeats_;
      }
      // Events are pushed during a step, its load published after it: a
      // report sent for fresh events may carry the step's load from before
      // (a prefill still queued). One more follows if the load moved since.
      settle = req.prefix_events_size() > 0;
      last_load = req.load().SerializeAsString();
      if (s.ok() && !resp.known()) {
        TLOG(WARNING, "the router forgot this worker; registering again")
            .Kv("worker_id", request_.worker_id());
        registered = false;
        absl::MutexLock l(&mu_);
        registered_ = false;
        continue;  // register at once
      }
      if (s.ok() && prefix_log_ != nullptr) {
        prefix_log_->OnHeartbeatResponse(resp);
        if (prefix_log_->needs_register()) {
          TLOG(INFO,
               "the router asked for the prefix cache's snapshot; registering "
               "again")
              .Kv("worker_id", request_.worker_id())
              .Kv("held", prefix_log_->held());
          registered = false;
          continue;  // register at once (registered_ stays: it is a resync)
        }
      }
    }
    // Sleep for the interval, waking early on stop or a nudge, and every
    // kPrefixReportInterval to send fresh prefix events at once.
    const absl::Time next = absl::Now() + interval;
    const bool poll = prefix_log_ != nullptr && registered;
    while (true) {
      bool nudged = false;
      {
        absl::MutexLock l(&mu_);
        auto wake = [this]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || nudged_; };
        const absl::Duration left = next - absl::Now();
        mu_.AwaitWithTimeout(absl::Condition(&wake),
                             poll ? std::min(left, kPrefixReportInterval) : left);
        if (stop_) return;
        nudged = nudged_;
        nudged_ = false;
      }
      if (nudged || !poll || absl::Now() >= next) break;
      DrainPrefixEvents();
      if (prefix_log_->has_pending() || prefix_log_->needs_register()) break;
      if (settle) {
        settle = false;
        if (load_().SerializeAsString() != last_load) break;
      }
    }
  }
}

}  // namespace tandem::worker
