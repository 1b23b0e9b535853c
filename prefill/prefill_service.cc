#include "prefill/prefill_service.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/sampling/proto_convert.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/plan.h"

namespace tandem::prefill {
namespace {

class PrefillReactor final : public grpc::ServerUnaryReactor {
 public:
  std::function<void()> on_cancel;
  void OnCancel() override {
    if (on_cancel) on_cancel();
  }
  void OnDone() override { delete this; }
};

absl::Time ContextDeadline(grpc::CallbackServerContext* context) {
  const auto d = context->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

tandem::v1::TransferStatus TransferStatusOf(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return tandem::v1::TRANSFER_STATUS_OK;
    case absl::StatusCode::kDeadlineExceeded:
      return tandem::v1::TRANSFER_STATUS_DEADLINE_EXCEEDED;
    case absl::StatusCode::kCancelled:
      return tandem::v1::TRANSFER_STATUS_CANCELLED;
    case absl::StatusCode::kInvalidArgument:
      return tandem::v1::TRANSFER_STATUS_INVALID_TARGET;
    default:
      return tandem::v1::TRANSFER_STATUS_PEER_UNREACHABLE;
  }
}

}  // namespace

struct PrefillService::Call {
  PrefillReactor* reactor = nullptr;                // valid until finished
  tandem::v1::PrefillResponse* response = nullptr;  // owned by gRPC, same
  std::atomic<bool> finished{false};
  tandem::v1::PrefillRequest request;
  kvtransfer::RankLayout dst;
  absl::Time deadline;
  absl::Time started;
  runtime::RequestId eid = 0;

  // The first caller wins; later ones do nothing.
  bool Finish(const grpc::Status& status) {
    if (finished.exchange(true)) return false;
    reactor->Finish(status);
    return true;
  }
};

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(
    worker::EngineLoop* loop, runtime::KvCache* cache, kvtransfer::TransferAgent* agent,
    worker::WorkerMetrics* metrics, PrefillServiceOptions options) {
  auto s = std::unique_ptr<PrefillService>(
      new PrefillService(loop, cache, agent, metrics, std::move(options)));
  TANDEM_ASSIGN_OR_RETURN(s->regions_, worker::RegisterCache(agent, cache));
  s->layout_ = worker::KvLayoutOf(*cache);
  return s;
}

PrefillService::PrefillService(worker::EngineLoop* loop, runtime::KvCache* cache,
                               kvtransfer::TransferAgent* agent,
                               worker::WorkerMetrics* metrics,
                               PrefillServiceOptions options)
    : loop_(loop),
      cache_(cache),
      agent_(agent),
      metrics_(metrics),
      options_(std::move(options)) {}

void PrefillService::Count(const char* rpc, const char* outcome) {
  if (metrics_ != nullptr) metrics_->CountRequest(rpc, outcome);
}

absl::StatusOr<kvtransfer::PeerId> PrefillService::PeerFor(
    const std::string& descriptor) {
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::AgentDescriptor d,
                          kvtransfer::ParseDescriptor(descriptor));
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(d.agent_id);
    if (it != peers_.end()) return it->second;
  }
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId p, agent_->Connect(descriptor));
  absl::MutexLock l(&mu_);
  peers_[d.agent_id] = p;
  return p;
}

void PrefillService::DropPeer(kvtransfer::PeerId peer) {
  {
    absl::MutexLock l(&mu_);
    for (auto it = peers_.begin(); it != peers_.end(); ++it) {
      if (it->second == peer) {
        peers_.erase(it);
        break;
      }
    }
  }
  agent_->Disconnect(peer).IgnoreError();
}

grpc::ServerUnaryReactor* PrefillService::Prefill(grpc::CallbackServerContext* context,
                                                  const tandem::v1::PrefillRequest* req,
                                                  tandem::v1::PrefillResponse* resp) {
  auto* reactor = new PrefillReactor();
  auto call = std::make_shared<Call>();
  call->reactor = reactor;
  call->response = resp;
  call->request = *req;
  call->started = absl::Now();
  call->deadline =
      std::min(ContextDeadline(context), call->started + options_.default_deadline);
  if (req->deadline_unix_ms() > 0) {
    call->deadline =
        std::min(call->deadline, absl::FromUnixMillis(req->deadline_unix_ms()));
  }
  auto refuse = [&](const absl::Status& s) {
    Count("Prefill", "invalid");
    TLOG(INFO, "prefill refused").Kv("request_id", req->request_id()).Kv("status", s);
    call->Finish(ToGrpcStatus(s));
    return reactor;
  };
  if (req->request_id().empty()) return refuse(InvalidArgument("request_id is empty"));
  if (req->prompt_token_ids_size() == 0) return refuse(InvalidArgument("empty prompt"));
  if (req->target().ranks_size() != 1) {
    return refuse(InvalidArgument("the target has ", req->target().ranks_size(),
                                  " ranks; this prefill worker (TP 1) needs 1"));
  }
  auto dst = worker::TargetRankLayout(req->target().ranks(0));
  if (!dst.ok()) return refuse(dst.status());
  {
    kvtransfer::RankLayout src = worker::CacheRankLayout(*cache_, regions_, {}, 0);
    absl::Status pair = kvtransfer::ValidatePair(src, *dst, 0);
    if (!pair.ok()) return refuse(pair);
    absl::Status one =
        kvtransfer::ValidateRankLayout(*dst, req->prompt_token_ids_size());
    if (!one.ok()) return refuse(one);
  }
  call->dst = std::move(*dst);
  // Prefill-only parameters: the request's sampling; stop conditions are the
  // decode worker's business (the router sends requests with min_tokens > 0 to
  // the colocated path, so no stop token is masked at the first token).
  auto params = engine::SamplingParamsFromProto(req->sampling(), {});
  if (!params.ok()) return refuse(params.status());
  params->ignore_eos = true;
  params->max_tokens = 0;
  if (!params->IsGreedy() && !params->seed.has_value()) {
    absl::BitGen gen;
    params->seed = absl::Uniform<uint64_t>(gen);
  }
  if (params->seed.has_value()) resp->set_seed(*params->seed);
  call->eid = next_engine_id_.fetch_add(1);
  {
    absl::MutexLock l(&mu_);
    if (active_.contains(req->request_id())) {
      return refuse(absl::AlreadyExistsError(
          absl::StrCat("request ", req->request_id(), " is already being prefilled")));
    }
    active_[req->request_id()] = call;
  }
  const std::string id = req->request_id();
  auto done = [this, id] {
    absl::MutexLock l(&mu_);
    active_.erase(id);
  };
  std::weak_ptr<Call> weak = call;
  reactor->on_cancel = [this, weak] {
    if (auto c = weak.lock()) CancelCall(c);
  };
  std::vector<int32_t> prompt(req->prompt_token_ids().begin(),
                              req->prompt_token_ids().end());
  loop_->AddRequest(
      call->eid, std::move(prompt), *params,
      [this, call, done](runtime::Engine& e,
                         const absl::StatusOr<runtime::RequestOutput>& out) {
        absl::Status s = out.status();
        if (s.ok() && out->new_tokens.empty()) return;  // not the first token yet
        // The state must not move while it is read: stop the request before the
        // next step (commands run before it).
        loop_->Cancel(call->eid, nullptr);
        done();
        if (s.ok()) s = Transfer(e, call.get(), *out);
        if (!s.ok()) {
          if (call->Finish(ToGrpcStatus(s))) {
            Count("Prefill", absl::StatusCodeToString(s.code()).c_str());
          }
          TLOG(WARNING, "prefill failed")
              .Kv("request_id", call->request.request_id())
              .Kv("status", s);
          return;
        }
        if (call->Finish(grpc::Status::OK)) Count("Prefill", "ok");
      });
  return reactor;
}

absl::Status PrefillService::Transfer(runtime::Engine& e, Call* call,
                                      const runtime::RequestOutput& out) {
  const tandem::v1::PrefillRequest& req = call->request;
  const int64_t n = req.prompt_token_ids_size();
  const absl::Time computed = absl::Now();
  if (call->finished.load()) return absl::CancelledError("prefill cancelled");
  TANDEM_ASSIGN_OR_RETURN(runtime::StateLocation loc, e.Locate(call->eid));
  if (loc.num_cached_tokens != n) {
    return Internal("request ", req.request_id(), ": ", loc.num_cached_tokens,
                    " cached tokens after prefill, expected ", n);
  }
  const kvtransfer::RankLayout src = worker::CacheRankLayout(
      *cache_, regions_, loc.block_ids, static_cast<int32_t>(loc.slot));
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::TransferPlan plan,
                          kvtransfer::PlanAll(src, call->dst, n));
  tandem::v1::PrefillResponse* resp = call->response;
  const kvtransfer::RegionBytes bytes = worker::CacheRegionBytes(cache_, regions_);
  if (req.checksums()) {
    TANDEM_ASSIGN_OR_RETURN(*resp->mutable_checksums(),
                            kvtransfer::ComputeChecksums(src, n, bytes));
  }
  if (options_.test_corrupt_transfer) {
    // TEST ONLY: damage the first byte the plan sends (after the checksums).
    const kvtransfer::Segment& s0 = plan.segments.front();
    absl::Span<const uint8_t> region = bytes(s0.local_region);
    const_cast<uint8_t*>(region.data())[s0.local_offset] ^= 0x5A;
    TLOG(WARNING, "TEST ONLY: corrupted one byte of the transfer")
        .Kv("request_id", req.request_id());
  }
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer,
                          PeerFor(req.target().ranks(0).transfer_descriptor()));
  const absl::Time t0 = absl::Now();
  absl::Status s;
  absl::StatusOr<kvtransfer::BatchId> batch = agent_->PostWrite(peer, plan.segments);
  if (!batch.ok()) {
    s = batch.status();
  } else {
    s = agent_->Wait(*batch, call->deadline);
    if (!s.ok()) agent_->Cancel(*batch).IgnoreError();
  }
  if (s.ok()) {
    s = agent_->Notify(peer, req.request_id(), "", call->deadline);
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  tandem::v1::TransferStats* ts = resp->mutable_transfer();
  ts->set_status(TransferStatusOf(s));
  ts->set_bytes(static_cast<int64_t>(plan.bytes));
  ts->set_segments(static_cast<int32_t>(plan.segments.size()));
  ts->set_seconds(secs);
  ts->set_transport(agent_->Transport(peer));
  if (metrics_ != nullptr) {
    metrics_->transfers->Add({{"outcome", s.ok() ? "ok" : "error"}}).Increment();
    if (s.ok()) {
      metrics_->transfer_bytes->Increment(static_cast<double>(plan.bytes));
      metrics_->transfer_seconds->Increment(secs);
    }
    metrics_->prefill_seconds->Observe(absl::ToDoubleSeconds(computed - call->started));
  }
  if (!s.ok()) {
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) DropPeer(peer);
    return absl::Status(s.code(),
                        absl::StrCat("transfer of request ", req.request_id(), " to ",
                                     req.target().ranks(0).transfer_address(),
                                     " failed: ", s.message()));
  }
  resp->set_request_id(req.request_id());
  resp->set_first_token_id(out.new_tokens.front());
  if (!out.logprobs.empty()) {
    engine::SampleResultToProto(out.logprobs.front(), resp->mutable_first_logprob());
  }
  resp->set_prefill_seconds(absl::ToDoubleSeconds(computed - call->started));
  TLOG(DEBUG, "prefill done")
      .Kv("request_id", req.request_id())
      .Kv("prompt_tokens", n)
      .Kv("bytes", plan.bytes)
      .Kv("segments", plan.segments.size())
      .Kv("transfer_s", secs);
  return absl::OkStatus();
}

void PrefillService::CancelCall(std::shared_ptr<Call> call) {
  loop_->Cancel(call->eid, [this, call] {
    {
      absl::MutexLock l(&mu_);
      active_.erase(call->request.request_id());
    }
    if (call->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "prefill cancelled"))) {
      Count("Prefill", "cancelled");
    }
  });
}

grpc::ServerUnaryReactor* PrefillService::Cancel(grpc::CallbackServerContext* context,
                                                 const tandem::v1::CancelRequest* req,
                                                 tandem::v1::CancelResponse* resp) {
  std::shared_ptr<Call> call;
  {
    absl::MutexLock l(&mu_);
    auto it = active_.find(req->request_id());
    if (it != active_.end()) call = it->second;
  }
  resp->set_found(call != nullptr);
  if (call != nullptr) CancelCall(call);
  Count("Cancel", resp->found() ? "ok" : "not_found");
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

tandem::v1::WorkerLoad PrefillService::Load() const {
  const worker::EngineLoopStats s = loop_->stats();
  tandem::v1::WorkerLoad load;
  load.set_queued_prefill_tokens(s.queued_prefill_tokens);
  load.set_running_requests(s.running);
  load.set_waiting_requests(s.waiting);
  load.set_free_kv_blocks(s.free_blocks);
  load.set_total_kv_blocks(s.total_blocks);
  load.set_free_state_slots(s.free_slots);
  load.set_total_state_slots(s.total_slots);
  load.set_kv_block_size(layout_.block_size());
  return load;
}

}  // namespace tandem::prefill
