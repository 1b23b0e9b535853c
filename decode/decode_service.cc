#include "decode/decode_service.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/sampling/proto_convert.h"
#include "kvtransfer/checksum.h"
#include "worker/engine_stream.h"

namespace tandem::decode {
namespace {

absl::Time ContextDeadline(grpc::CallbackServerContext* context) {
  const auto d = context->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

grpc::Status Grpc(const absl::Status& s) { return ToGrpcStatus(s); }

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(
    worker::EngineLoop* loop, engine::KvCache* landing,
    kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
    DecodeServiceOptions options) {
  return Create(loop, std::vector<engine::KvCache*>{landing}, agent, metrics,
                std::move(options));
}

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(
    worker::EngineLoop* loop, std::vector<engine::KvCache*> landing,
    kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
    DecodeServiceOptions options) {
  if (landing.empty()) return InvalidArgument("no landing pool");
  for (engine::KvCache* c : landing) {
    if (c->num_blocks() != landing[0]->num_blocks() ||
        c->num_slots() != landing[0]->num_slots()) {
      return InvalidArgument("the ranks' landing pools differ in blocks or slots");
    }
  }
  auto s = std::unique_ptr<DecodeService>(
      new DecodeService(loop, std::move(landing), agent, metrics, std::move(options)));
  // Every rank's pool first, so each descriptor carries every region's key.
  for (engine::KvCache* c : s->landing_) {
    TANDEM_ASSIGN_OR_RETURN(worker::CacheRegions r,
                            worker::RegisterCache(agent, c, s->options_.allocations));
    s->regions_.push_back(std::move(r));
    s->layouts_.push_back(worker::KvLayoutOf(*c));
  }
  for (int r = 0; r < s->tp(); ++r) {
    const kvtransfer::RankLayout geometry =
        worker::CacheRankLayout(*s->landing_[r], s->regions_[r], {}, 0);
    TANDEM_ASSIGN_OR_RETURN(std::string d,
                            agent->LocalDescriptor(worker::PoolsMetadata(geometry)));
    s->descriptors_.push_back(std::move(d));
  }
  s->layout_ = s->layouts_[0];
  DecodeService* raw = s.get();
  agent->SetNotificationCallback(
      [raw](const kvtransfer::Notification& n) { raw->OnNotification(n); });
  s->janitor_ = std::thread([raw] { raw->Janitor(); });
  return s;
}

DecodeService::DecodeService(worker::EngineLoop* loop,
                             std::vector<engine::KvCache*> landing,
                             kvtransfer::TransferAgent* agent,
                             worker::WorkerMetrics* metrics,
                             DecodeServiceOptions options)
    : loop_(loop),
      landing_(std::move(landing)),
      agent_(agent),
      metrics_(metrics),
      options_(std::move(options)),
      blocks_(static_cast<int32_t>(landing_[0]->num_blocks())),
      slots_(static_cast<int32_t>(landing_[0]->num_slots())) {}

absl::Status DecodeService::Usable() const {
  const absl::Status h = loop_->health();
  if (h.ok()) return h;
  return absl::UnavailableError(
      absl::StrCat("decode worker ", options_.worker_id,
                   " is not taking work: its engine failed: ", h.message()));
}

DecodeService::~DecodeService() {
  agent_->SetNotificationCallback(nullptr);
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (janitor_.joinable()) janitor_.join();
}

void DecodeService::Count(const char* rpc, const char* outcome) {
  if (metrics_ != nullptr) metrics_->CountRequest(rpc, outcome);
}

void DecodeService::ReleaseLocked(std::vector<int32_t>* blocks, int32_t* slot) {
  for (int32_t b : *blocks) blocks_.Free(b).IgnoreError();
  blocks->clear();
  if (*slot >= 0) slots_.Release(*slot).IgnoreError();
  *slot = -1;
}

void DecodeService::FreeLocked(Reservation* r) {
  if (r->landed || options_.unlanded_quarantine <= absl::ZeroDuration() ||
      (r->blocks.empty() && r->slot < 0)) {
    ReleaseLocked(&r->blocks, &r->slot);
    return;
  }
  // The prefill worker may still be writing: keep the memory out of use.
  Quarantined q;
  q.blocks = std::move(r->blocks);
  q.slot = r->slot;
  q.until = absl::Now() + options_.unlanded_quarantine;
  quarantine_.push_back(std::move(q));
  r->blocks.clear();
  r->slot = -1;
}

grpc::ServerUnaryReactor* DecodeService::Reserve(grpc::CallbackServerContext* context,
                                                 const tandem::v1::ReserveRequest* req,
                                                 tandem::v1::KvTarget* resp) {
  auto* reactor = context->DefaultReactor();
  auto status = [&]() -> absl::Status {
    if (req->request_id().empty()) return InvalidArgument("request_id is empty");
    if (req->prompt_tokens() <= 0) {
      return InvalidArgument("prompt_tokens must be > 0, got ", req->prompt_tokens());
    }
    TANDEM_RETURN_IF_ERROR(Usable());
    // The router's registry only pairs equal TP sizes and the prefill worker
    // refuses a target with another number of ranks; this is the third check.
    if (req->prefill_tp_size() > 0 && req->prefill_tp_size() != tp()) {
      return FailedPrecondition("prefill TP ", req->prefill_tp_size(),
                                " cannot hand off to this decode worker's TP ", tp(),
                                ": KV re-layout between TP sizes is not supported");
    }
    const int64_t bs = landing_[0]->block_size();
    const int64_t need = (req->prompt_tokens() + bs - 1) / bs;
    if (need > landing_[0]->num_blocks()) {
      return InvalidArgument("prompt of ", req->prompt_tokens(),
                             " tokens is larger than this worker's landing pool (",
                             landing_[0]->num_blocks() * bs, " tokens)");
    }
    absl::Duration lease =
        req->lease_ms() > 0
            ? std::min(absl::Milliseconds(req->lease_ms()), options_.max_lease)
            : options_.default_lease;
    absl::MutexLock l(&mu_);
    if (reservations_.contains(req->request_id())) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", req->request_id(), " already has a reservation"));
    }
    if (need > blocks_.num_free() || slots_.num_free() == 0) {
      return ResourceExhausted("decode worker ", options_.worker_id, " cannot hold ",
                               req->prompt_tokens(), " more tokens now (",
                               blocks_.num_free(), " blocks, ", slots_.num_free(),
                               " slots free)");
    }
    Reservation r;
    TANDEM_RETURN_IF_ERROR(blocks_.AllocateN(need, &r.blocks));
    auto slot = slots_.Acquire();
    if (!slot.ok()) {
      FreeLocked(&r);
      return slot.status();
    }
    r.slot = *slot;
    r.prompt_tokens = req->prompt_tokens();
    r.lease_expiry = absl::Now() + lease;
    resp->set_request_id(req->request_id());
    resp->set_decode_worker_id(options_.worker_id);
    resp->set_lease_expiry_unix_ms(absl::ToUnixMillis(r.lease_expiry));
    for (int k = 0; k < tp(); ++k) {  // the same blocks and slot in every rank
      tandem::v1::RankTarget* t = resp->add_ranks();
      t->set_transfer_descriptor(descriptors_[k]);
      t->set_transfer_address(absl::StrFormat("agent:%016x", agent_->AgentId()));
      for (int32_t b : r.blocks) t->add_block_ids(b);
      t->set_state_slot(r.slot);
      *t->mutable_layout() = layouts_[k];
    }
    reservations_.emplace(req->request_id(), std::move(r));
    return absl::OkStatus();
  }();
  Count("Reserve",
        status.ok() ? "ok" : absl::StatusCodeToString(status.code()).c_str());
  TLOG(DEBUG, "reserve")
      .Kv("request_id", req->request_id())
      .Kv("prompt_tokens", req->prompt_tokens())
      .Kv("status", status);
  reactor->Finish(Grpc(status));
  return reactor;
}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* DecodeService::Decode(
    grpc::CallbackServerContext* context, const tandem::v1::DecodeRequest* req) {
  auto* stream = new rpc::ResponseStream();
  const std::string id = req->request_id();
  const engine::RequestId eid = next_engine_id_.fetch_add(1);
  absl::Time deadline =
      std::min(absl::Now() + options_.max_landing_wait, ContextDeadline(context));
  if (req->deadline_unix_ms() > 0) {
    deadline = std::min(deadline, absl::FromUnixMillis(req->deadline_unix_ms()));
  }
  std::optional<Reservation> ready;
  {
    absl::MutexLock l(&mu_);
    auto it = reservations_.find(id);
    if (it == reservations_.end()) {
      Count("Decode", "not_found");
      stream->Close(Grpc(NotFound(
          "no reservation for request '", id, "' on decode worker ", options_.worker_id,
          " (never reserved, released, or its lease expired)")));
      return stream;
    }
    Reservation& r = it->second;
    if (r.waiting != nullptr) {
      Count("Decode", "invalid");
      stream->Close(Grpc(FailedPrecondition("request '", id, "' is already decoding")));
      return stream;
    }
    r.waiting = stream;
    r.pending = *req;
    r.pending.set_request_id(absl::StrCat(eid));  // engine id rides along
    r.wait_deadline = deadline;
    r.decode_started = absl::Now();
    if (r.landed) {
      ready = std::move(r);
      reservations_.erase(it);
    }
  }
  // Cancellation: before admission the reservation is freed; after it the
  // engine request is aborted (its blocks and slot freed).
  stream->SetOnCancel([this, id, stream, eid] {
    bool closed = false;
    {
      absl::MutexLock l(&mu_);
      auto it = reservations_.find(id);
      if (it != reservations_.end() && it->second.waiting == stream) {
        FreeLocked(&it->second);
        reservations_.erase(it);
        closed = true;
      }
    }
    if (closed) {
      Count("Decode", "cancelled");
      stream->Close(
          grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
      return;
    }
    loop_->Cancel(eid, [this, stream] {
      Count("Decode", "cancelled");
      stream->Close(
          grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
    });
  });
  if (ready.has_value()) StartDecode(id, std::move(*ready));
  return stream;
}

void DecodeService::OnNotification(const kvtransfer::Notification& n) {
  std::optional<Reservation> ready;
  {
    absl::MutexLock l(&mu_);
    auto it = reservations_.find(n.request_id);
    if (it == reservations_.end()) {
      TLOG(WARNING, "state arrived for an unknown reservation")
          .Kv("request_id", n.request_id);
      return;
    }
    it->second.landed = true;
    if (it->second.waiting != nullptr) {
      ready = std::move(it->second);
      reservations_.erase(it);
    }
  }
  if (ready.has_value()) StartDecode(n.request_id, std::move(*ready));
}

void DecodeService::StartDecode(std::string id, Reservation r) {
  rpc::ResponseStream* stream = r.waiting;
  const tandem::v1::DecodeRequest& req = r.pending;
  engine::RequestId eid = 0;
  absl::SimpleAtoi(req.request_id(), &eid);
  auto fail = [&](const absl::Status& s, const char* outcome) {
    {
      absl::MutexLock l(&mu_);
      FreeLocked(&r);
    }
    Count("Decode", outcome);
    TLOG(WARNING, "decode refused").Kv("request_id", id).Kv("status", s);
    stream->Close(Grpc(s));
  };
  const tandem::v1::StateChecksums& want = req.checksums();
  if (want.mla_layer_size() + want.kda_layer_size() > 0) {
    std::vector<tandem::v1::StateChecksums> ranks;
    for (int k = 0; k < tp(); ++k) {
      const kvtransfer::RankLayout side =
          worker::CacheRankLayout(*landing_[k], regions_[k], r.blocks, r.slot);
      auto got = kvtransfer::ComputeChecksums(
          side, r.prompt_tokens, worker::CacheRegionBytes(landing_[k], regions_[k]));
      if (!got.ok()) return fail(got.status(), "error");
      ranks.push_back(std::move(*got));
    }
    const tandem::v1::StateChecksums got = worker::MergeRankChecksums(ranks);
    if (absl::Status v = kvtransfer::Verify(want, got); !v.ok()) {
      return fail(
          absl::DataLossError(absl::StrCat(
              "request ", id, ": the transferred state is corrupt: ", v.message())),
          "data_loss");
    }
  }
  auto params = engine::SamplingParamsFromProto(req.sampling(), req.stop());
  if (!params.ok()) return fail(params.status(), "invalid");
  if (req.prompt_token_ids_size() != r.prompt_tokens) {
    return fail(
        InvalidArgument("request ", id, ": prompt has ", req.prompt_token_ids_size(),
                        " tokens but ", r.prompt_tokens, " were reserved"),
        "invalid");
  }
  engine::ExportedState state;
  state.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  state.generated = {req.first_token_id()};
  state.num_cached_tokens = r.prompt_tokens;
  for (engine::KvCache* pool : landing_) {  // rank-major, each range its rank's
    auto ranges = pool->ExportSequence(r.blocks, r.prompt_tokens, r.slot);
    if (!ranges.ok()) return fail(ranges.status(), "error");
    state.ranges.insert(state.ranges.end(), ranges->begin(), ranges->end());
  }
  loop_->Post([this, id, eid, stream, r = std::move(r), state = std::move(state),
               params = *params](engine::Engine& e) mutable {
    const tandem::v1::DecodeRequest& req = r.pending;
    auto out = e.AddPrefilledRequestWithOutput(eid, state, params);
    {
      absl::MutexLock l(&mu_);
      FreeLocked(&r);  // the state was copied into the engine's cache
    }
    if (!out.ok()) {
      Count("Decode", "error");
      TLOG(WARNING, "admission failed").Kv("request_id", id).Kv("status", out.status());
      stream->Close(Grpc(out.status()));
      return;
    }
    tandem::v1::GenerateResponse m =
        worker::OutputToMessage(id, *out, req.return_text());
    if (params.logprobs && req.has_first_logprob()) {
      *m.add_logprobs() = req.first_logprob();
    }
    if (params.seed.has_value()) m.set_seed(*params.seed);
    const absl::Time now = absl::Now();
    if (metrics_ != nullptr) {
      metrics_->ttft->Observe(absl::ToDoubleSeconds(now - r.decode_started));
    }
    TLOG(DEBUG, "decode admitted").Kv("request_id", id).Kv("engine_id", eid);
    if (out->finished) {
      m.mutable_usage()->set_prompt_tokens(r.prompt_tokens);
      m.mutable_usage()->set_completion_tokens(
          static_cast<int32_t>(out->new_tokens.size()));
      stream->Push(std::move(m));
      Count("Decode", "ok");
      stream->Close(grpc::Status::OK);
      return;
    }
    stream->Push(std::move(m));
    worker::EngineStreamOptions so;
    so.request_id = id;
    so.prompt_tokens = r.prompt_tokens;
    so.return_text = req.return_text();
    so.rpc = "Decode";
    so.started = r.decode_started;
    so.tokens_already_sent = 1;
    loop_->WatchOnLoopThread(eid, worker::StreamEngineOutputs(stream, metrics_, so));
  });
}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* DecodeService::Generate(
    grpc::CallbackServerContext* context, const tandem::v1::GenerateRequest* req) {
  auto* stream = new rpc::ResponseStream();
  if (!req->has_prompt_token_ids() || req->prompt_token_ids().ids_size() == 0) {
    Count("Generate", "invalid");
    stream->Close(
        Grpc(InvalidArgument("the decode worker takes prompt_token_ids (the router "
                             "tokenises prompt_text)")));
    return stream;
  }
  if (absl::Status u = Usable(); !u.ok()) {
    Count("Generate", "unavailable");
    stream->Close(Grpc(u));
    return stream;
  }
  auto params = engine::SamplingParamsFromProto(req->sampling(), req->stop());
  if (!params.ok()) {
    Count("Generate", "invalid");
    stream->Close(Grpc(params.status()));
    return stream;
  }
  if (!params->IsGreedy() && !params->seed.has_value()) {
    absl::BitGen gen;
    params->seed = absl::Uniform<uint64_t>(gen);
  }
  const engine::RequestId eid = next_engine_id_.fetch_add(1);
  std::vector<int32_t> prompt(req->prompt_token_ids().ids().begin(),
                              req->prompt_token_ids().ids().end());
  worker::EngineStreamOptions so;
  so.request_id = req->request_id();
  so.prompt_tokens = static_cast<int32_t>(prompt.size());
  so.return_text = req->return_text();
  so.seed = params->seed;
  so.rpc = "Generate";
  so.started = absl::Now();
  loop_->AddRequest(eid, std::move(prompt), *params,
                    worker::StreamEngineOutputs(stream, metrics_, so));
  stream->SetOnCancel([this, eid, stream] {
    loop_->Cancel(eid, [this, stream] {
      Count("Generate", "cancelled");
      stream->Close(
          grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
    });
  });
  return stream;
}

grpc::ServerUnaryReactor* DecodeService::Release(grpc::CallbackServerContext* context,
                                                 const tandem::v1::ReleaseRequest* req,
                                                 tandem::v1::ReleaseResponse* resp) {
  rpc::ResponseStream* waiting = nullptr;
  {
    absl::MutexLock l(&mu_);
    auto it = reservations_.find(req->request_id());
    if (it != reservations_.end()) {
      resp->set_found(true);
      waiting = it->second.waiting;
      FreeLocked(&it->second);
      reservations_.erase(it);
    }
  }
  if (waiting != nullptr) {
    waiting->Close(
        grpc::Status(grpc::StatusCode::ABORTED,
                     "the reservation was released before the state arrived"));
  }
  Count("Release", resp->found() ? "ok" : "not_found");
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void DecodeService::Janitor() {
  while (true) {
    std::vector<std::pair<std::string, rpc::ResponseStream*>> timed_out;
    {
      absl::MutexLock l(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.janitor_period);
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (auto q = quarantine_.begin(); q != quarantine_.end();) {
        if (now >= q->until) {
          ReleaseLocked(&q->blocks, &q->slot);
          q = quarantine_.erase(q);
        } else {
          ++q;
        }
      }
      for (auto it = reservations_.begin(); it != reservations_.end();) {
        Reservation& r = it->second;
        const bool wait_over = r.waiting != nullptr && now > r.wait_deadline;
        const bool lease_over = r.waiting == nullptr && now > r.lease_expiry;
        if (wait_over || lease_over) {
          if (wait_over) timed_out.emplace_back(it->first, r.waiting);
          if (lease_over) {
            TLOG(INFO, "reservation lease expired").Kv("request_id", it->first);
          }
          FreeLocked(&r);
          reservations_.erase(it++);
        } else {
          ++it;
        }
      }
      if (metrics_ != nullptr) {
        metrics_->reservations->Set(static_cast<double>(reservations_.size()));
        metrics_->landing_blocks->Add({{"state", "free"}}).Set(blocks_.num_free());
        metrics_->landing_blocks->Add({{"state", "used"}}).Set(blocks_.num_used());
      }
    }
    for (auto& [id, stream] : timed_out) {
      Count("Decode", "deadline_exceeded");
      stream->Close(Grpc(absl::DeadlineExceededError(
          absl::StrCat("request ", id,
                       ": the prefilled state did not arrive before the deadline"))));
    }
  }
}

tandem::v1::WorkerLoad DecodeService::Load() const {
  const worker::EngineLoopStats s = loop_->stats();
  tandem::v1::WorkerLoad load;
  load.set_queued_prefill_tokens(s.queued_prefill_tokens);
  load.set_running_requests(s.running);
  load.set_waiting_requests(s.waiting);
  absl::MutexLock l(&mu_);
  load.set_free_kv_blocks(
      std::max(0, std::min(s.free_blocks - blocks_.num_used(), blocks_.num_free())));
  load.set_total_kv_blocks(s.total_blocks);
  load.set_free_state_slots(
      std::max(0, std::min(s.free_slots - slots_.num_used(), slots_.num_free())));
  load.set_total_state_slots(s.total_slots);
  load.set_kv_block_size(layout_.block_size());
  return load;
}

int64_t DecodeService::num_reservations() const {
  absl::MutexLock l(&mu_);
  return reservations_.size();
}

int32_t DecodeService::landing_free_blocks() const {
  absl::MutexLock l(&mu_);
  return blocks_.num_free();
}

}  // namespace tandem::decode
