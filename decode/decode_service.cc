#include "decode/decode_service.h"

#include <xxhash.h>

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/sampling/proto_convert.h"
#include "engine/sampling/sampling_params.h"
#include "kvtransfer/checksum.h"
#include "rpc/deadline.h"
#include "worker/engine_stream.h"
#include "worker/prefix_cache_reset.h"
#include "worker/worker_load.h"

namespace tandem::decode {
namespace {

grpc::Status Grpc(const absl::Status& s) { return ToGrpcStatus(s); }

grpc::Status Cancelled() {
  return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
}

// A prompt's token ids, hashed (ReservationInfo::prompt_fingerprint); never 0.
uint64_t PromptFingerprint(const google::protobuf::RepeatedField<int32_t>& ids) {
  const uint64_t h = XXH3_64bits(ids.data(), sizeof(int32_t) * ids.size());
  return h == 0 ? 1 : h;
}

}  // namespace

// The Decode call waiting on a reservation (owned by the table while LANDING).
class DecodeService::DecodeWaiter final : public Waiter {
 public:
  DecodeWaiter(rpc::ResponseStream* stream, const tandem::v1::DecodeRequest& request)
      : stream(stream), request(request) {}
  rpc::ResponseStream* const stream;  // not owned (the producer's reference)
  const tandem::v1::DecodeRequest request;
};

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(
    worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
    kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
    DecodeServiceOptions options) {
  if (caches.empty()) return InvalidArgument("no engine cache");
  for (engine::KvCache* c : caches) {
    if (c->num_blocks() != caches[0]->num_blocks() ||
        c->num_slots() != caches[0]->num_slots()) {
      return InvalidArgument("the ranks' caches differ in blocks or slots");
    }
  }
  auto s = std::unique_ptr<DecodeService>(
      new DecodeService(loop, std::move(caches), agent, metrics, std::move(options)));
  // Every rank's cache first, so each descriptor carries every region's key.
  for (engine::KvCache* c : s->caches_) {
    TANDEM_ASSIGN_OR_RETURN(worker::CacheRegions r,
                            worker::RegisterCache(agent, c, s->options_.allocations));
    s->staged_ = s->staged_ || r.staged;
    s->regions_.push_back(std::move(r));
    s->layouts_.push_back(worker::KvLayoutOf(*c));
  }
  // Staged caches (--kv_buffer): the landed state is copied to the device
  // before it is verified and admitted (Land).
  s->staging_ = dynamic_cast<kvtransfer::HostStagingAgent*>(agent);
  if (s->staged_ && s->staging_ == nullptr) {
    return Internal("the cache is staged through host memory without a staging agent");
  }
  const std::vector<kernels::Backend*>& devices = s->options_.checksum_backends;
  if (!devices.empty() && static_cast<int>(devices.size()) != s->tp()) {
    return InvalidArgument(devices.size(), " checksum backends for ", s->tp(),
                           " ranks");
  }
  for (int r = 0; r < s->tp(); ++r) {
    if (devices.empty()) {
      s->checksum_memory_.push_back(
          {worker::CacheRegionBytes(s->caches_[r], s->regions_[r]), true, nullptr});
      continue;
    }
    if (devices[r] == nullptr)
      return InvalidArgument("checksum backend ", r, " is null");
    s->hashers_.push_back(std::make_unique<worker::BackendChunkHasher>(devices[r]));
    s->checksum_memory_.push_back(worker::CacheChecksumMemory(
        s->caches_[r], s->regions_[r], s->hashers_.back().get(), devices[r]->device()));
  }
  if (!devices.empty()) {
    TLOG(INFO, "state checksums computed on the device")
        .Kv("backend", devices[0]->name())
        .Kv("device", devices[0]->device().name())
        .Kv("tp_ranks", devices.size());
  }
  for (int r = 0; r < s->tp(); ++r) {
    const kvtransfer::RankLayout geometry =
        worker::CacheRankLayout(*s->caches_[r], s->regions_[r], {}, 0);
    TANDEM_ASSIGN_OR_RETURN(std::string d,
                            agent->LocalDescriptor(worker::PoolsMetadata(geometry)));
    s->descriptors_.push_back(std::move(d));
  }
  s->layout_ = s->layouts_[0];
  DecodeService* raw = s.get();
  s->lander_ = std::thread([raw] { raw->LandLoop(); });
  agent->SetNotificationCallback(
      [raw](const kvtransfer::Notification& n) { raw->OnNotification(n); });
  if (s->options_.start_janitor) {
    s->janitor_ = std::thread([raw] {
      while (true) {
        {
          absl::MutexLock l(&raw->mu_);
          if (raw->mu_.AwaitWithTimeout(absl::Condition(&raw->stop_),
                                        raw->options_.janitor_period)) {
            return;
          }
        }
        raw->Tick(raw->clock_->Now());
      }
    });
  }
  return s;
}

DecodeService::DecodeService(worker::EngineLoop* loop,
                             std::vector<engine::KvCache*> caches,
                             kvtransfer::TransferAgent* agent,
                             worker::WorkerMetrics* metrics,
                             DecodeServiceOptions options)
    : loop_(loop),
      caches_(std::move(caches)),
      agent_(agent),
      metrics_(metrics),
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      table_(clock_, ReservationsOptions{options_.unlanded_quarantine}) {}

DecodeService::~DecodeService() { Stop(); }

void DecodeService::Stop() {
  agent_->SetNotificationCallback(nullptr);
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (janitor_.joinable()) janitor_.join();
  // The landings already handed over are still started (the engine loop
  // outlives Stop), then the lander ends.
  {
    absl::MutexLock l(&land_mu_);
    land_stop_ = true;
  }
  if (lander_.joinable()) lander_.join();
}

absl::Status DecodeService::Usable() const {
  const absl::Status h = loop_->health();
  if (h.ok()) return h;
  return absl::UnavailableError(
      absl::StrCat("decode worker ", options_.worker_id,
                   " is not taking work: its engine failed: ", h.message()));
}

void DecodeService::Count(const char* rpc, const char* outcome) {
  if (metrics_ != nullptr) metrics_->CountRequest(rpc, outcome);
}

void DecodeService::FreeInEngine(const ReservationInfo& info) {
  // A staged cache that gives pages back: what landed (or was still landing)
  // in the shadows for this reservation and was never staged in goes back
  // too, before the blocks can be reserved again (idempotent after StageIn).
  if (staging_ != nullptr && staging_->release_pages() && !info.landed_on_device) {
    for (int k = 0; k < tp(); ++k) {
      if (!regions_[k].staged) continue;
      absl::StatusOr<std::vector<kvtransfer::ByteRange>> ranges =
          worker::LandedRanges(*caches_[k], regions_[k], info.blocks, info.slot,
                               info.prompt_tokens, info.held_tokens);
      if (!ranges.ok()) continue;
      std::erase_if(*ranges, [this](const kvtransfer::ByteRange& b) {
        return !staging_->IsStaged(b.region);
      });
      staging_->Discard(*ranges).IgnoreError();
    }
  }
  loop_->Abort(info.engine_id);  // Engine::Abort frees a reservation
}

grpc::ServerUnaryReactor* DecodeService::Reserve(grpc::CallbackServerContext* context,
                                                 const tandem::v1::ReserveRequest* req,
                                                 tandem::v1::KvTarget* resp) {
  auto* reactor = context->DefaultReactor();
  auto finish = [this, reactor, req](const absl::Status& status) {
    Count("Reserve",
          status.ok() ? "ok" : absl::StatusCodeToString(status.code()).c_str());
    TLOG(DEBUG, "reserve")
        .Kv("request_id", req->request_id())
        .Kv("prompt_tokens", req->prompt_tokens())
        .Kv("status", status);
    reactor->Finish(Grpc(status));
  };
  absl::Status status = [&]() -> absl::Status {
    if (req->request_id().empty()) return InvalidArgument("request_id is empty");
    if (req->prompt_tokens() <= 0) {
      return InvalidArgument("prompt_tokens must be > 0, got ", req->prompt_tokens());
    }
    TANDEM_RETURN_IF_ERROR(Usable());
    // The router's registry only pairs equal TP sizes and the prefill worker
    // refuses a target with another number of ranks; this is the third check.
    if (req->prompt_token_ids_size() > 0 &&
        req->prompt_token_ids_size() != req->prompt_tokens()) {
      return InvalidArgument("prompt_token_ids has ", req->prompt_token_ids_size(),
                             " tokens but prompt_tokens is ", req->prompt_tokens());
    }
    if (req->prefill_tp_size() > 0 && req->prefill_tp_size() != tp()) {
      return FailedPrecondition("prefill TP ", req->prefill_tp_size(),
                                " cannot hand off to this decode worker's TP ", tp(),
                                ": KV re-layout between TP sizes is not supported");
    }
    if (table_.State(req->request_id()).has_value()) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", req->request_id(), " already has a reservation"));
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    finish(status);
    return reactor;
  }
  const absl::Duration lease =
      req->lease_ms() > 0
          ? std::min(absl::Milliseconds(req->lease_ms()), options_.max_lease)
          : options_.default_lease;
  const engine::RequestId eid = next_engine_id_.fetch_add(1);
  // The allocation is the engine's: answered from its thread, between steps.
  loop_->Post([this, context, req, resp, eid, lease, finish](engine::Engine& e) {
    // The router may have given up while the command waited for a step (its
    // deadline, or a cancel): it will not use, nor release, what is made now.
    if (context->IsCancelled()) {
      finish(absl::CancelledError(
          absl::StrCat("request ", req->request_id(),
                       ": Reserve cancelled before the engine ran it")));
      return;
    }
    finish(ReserveOnLoop(e, *req, eid, lease, resp));
  });
  return reactor;
}

absl::Status DecodeService::ReserveOnLoop(engine::Engine& e,
                                          const tandem::v1::ReserveRequest& req,
                                          engine::RequestId eid, absl::Duration lease,
                                          tandem::v1::KvTarget* resp) {
  // With the prompt's ids and the router's word that the prefill worker
  // writing this honours held rows (share_held_prefix): the blocks of it the
  // cache holds are shared (a decode-side prefix hit), and the prefill worker
  // skips their rows. Without that word (a router older than the field, or a
  // prefill worker that would write every row from 0 into blocks other
  // sequences share) nothing is shared; the landed prompt is still cached.
  // The prompt's images as spans without embeddings (this worker has no
  // vision tower): their hashes enter the cache keys, and their rows are
  // never recomputed here.
  std::vector<engine::MediaInput> media;
  media.reserve(req.images_size());
  for (const tandem::v1::ImageInput& im : req.images()) {
    media.push_back({.position = im.placeholder_start(),
                     .rows = im.num_tokens(),
                     .content_hash = im.content_hash()});
  }
  absl::StatusOr<engine::StateLocation> loc = e.Reserve(
      eid, req.prompt_tokens(),
      absl::MakeConstSpan(req.prompt_token_ids().data(), req.prompt_token_ids_size()),
      req.cache_salt(), /*share_held_prefix=*/req.share_held_prefix(),
      std::move(media));
  if (!loc.ok()) {
    if (absl::IsResourceExhausted(loc.status())) {
      return ResourceExhausted("decode worker ", options_.worker_id, " cannot hold ",
                               req.prompt_tokens(), " more tokens now (",
                               e.num_free_blocks(), " blocks, ", e.num_free_slots(),
                               " slots free): ", loc.status().message());
    }
    return loc.status();
  }
  ReservationInfo info;
  info.request_id = req.request_id();
  info.engine_id = eid;
  info.blocks = loc->block_ids;
  info.slot = static_cast<int32_t>(loc->slot);
  info.prompt_tokens = req.prompt_tokens();
  info.held_tokens = static_cast<int32_t>(loc->held_prefix_tokens);
  if (req.prompt_token_ids_size() > 0) {
    info.prompt_fingerprint = PromptFingerprint(req.prompt_token_ids());
  }
  absl::StatusOr<ReservationInfo> added = table_.Add(std::move(info), lease);
  if (!added.ok()) {  // a concurrent Reserve of the same id won
    e.Abort(eid).IgnoreError();
    return added.status();
  }
  resp->set_request_id(req.request_id());
  resp->set_decode_worker_id(options_.worker_id);
  resp->set_lease_expiry_unix_ms(absl::ToUnixMillis(added->lease_expiry));
  // The engine id is unique per reservation: the notification must carry it.
  resp->set_reservation_token(static_cast<uint64_t>(eid));
  resp->set_cached_prefix_tokens(static_cast<int32_t>(loc->held_prefix_tokens));
  for (int k = 0; k < tp(); ++k) {  // the same blocks and slot in every rank
    tandem::v1::RankTarget* t = resp->add_ranks();
    t->set_transfer_descriptor(descriptors_[k]);
    t->set_transfer_address(absl::StrFormat("agent:%016x", agent_->AgentId()));
    for (int32_t b : added->blocks) t->add_block_ids(b);
    t->set_state_slot(added->slot);
    *t->mutable_layout() = layouts_[k];
  }
  return absl::OkStatus();
}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* DecodeService::Decode(
    grpc::CallbackServerContext* context, const tandem::v1::DecodeRequest* req) {
  auto* stream = new rpc::ResponseStream();
  const std::string id = req->request_id();
  const absl::Time deadline =
      rpc::WithUnixMillis(std::min(clock_->Now() + options_.max_landing_wait,
                                   rpc::ContextDeadline(*context)),
                          req->deadline_unix_ms());
  engine::RequestId eid = 0;
  absl::StatusOr<std::optional<Handoff>> ready =
      table_.Decode(id, std::make_unique<DecodeWaiter>(stream, *req), deadline, &eid);
  if (!ready.ok()) {
    const bool missing = absl::IsNotFound(ready.status());
    Count("Decode", missing ? "not_found" : "invalid");
    stream->Close(Grpc(missing ? NotFound(ready.status().message(),
                                          " on decode worker ", options_.worker_id)
                               : ready.status()));
    return stream;
  }
  stream->SetOnCancel([this, id, eid, stream] { OnDecodeCancel(id, eid, stream); });
  if (ready->has_value()) Enqueue(std::move(**ready), /*on_rpc_thread=*/true);
  return stream;
}

void DecodeService::OnDecodeCancel(const std::string& id, engine::RequestId eid,
                                   rpc::ResponseStream* stream) {
  Removal c = table_.Cancel(id, eid);
  if (c.found && c.was == ReservationState::kLanding) {
    // Before the state landed: quarantined (or freed with no quarantine).
    if (c.free_now) FreeInEngine(c.info);
    Count("Decode", "cancelled");
    stream->Close(Cancelled());
    return;
  }
  // ADMITTED (or ended meanwhile): the engine's. The admission itself checks
  // for a cancel it overtook (StartDecode).
  loop_->Cancel(eid, [this, id, eid, stream] {
    table_.Finish(id, eid);
    Count("Decode", "cancelled");
    stream->Close(Cancelled());
  });
}

void DecodeService::OnNotification(const kvtransfer::Notification& n) {
  // The payload names the reservation the state was written into (KvTarget's
  // reservation_token); empty from a sender that has none.
  std::optional<int64_t> token;
  if (!n.payload.empty()) {
    int64_t t = 0;
    if (!absl::SimpleAtoi(n.payload, &t)) {
      TLOG(WARNING, "state notification with a malformed reservation token dropped")
          .Kv("request_id", n.request_id)
          .Kv("payload_bytes", n.payload.size());
      return;
    }
    token = t;
  }
  absl::StatusOr<std::optional<Handoff>> ready =
      table_.Landed(n.request_id, token, n.on_device);
  if (!ready.ok()) {
    TLOG(WARNING, "state notification not taken")
        .Kv("request_id", n.request_id)
        .Kv("status", ready.status());
    return;
  }
  if (!ready->has_value()) return;
  Enqueue(std::move(**ready), /*on_rpc_thread=*/false);
}

void DecodeService::Enqueue(Handoff h, bool on_rpc_thread) {
  // A host cache's checksums need no engine pause: on the RPC's own thread,
  // in parallel with the other hand-offs' (not on the agent's progress thread,
  // which the transfers need).
  if (on_rpc_thread && hashers_.empty() && !staged_) {
    if (!NeedsLanding(h)) return StartDecode(std::move(h), nullptr);
    const absl::Time t0 = absl::Now();
    std::vector<absl::StatusOr<tandem::v1::StateChecksums>> sums = Land({ItemOf(h)});
    if (metrics_ != nullptr) {
      metrics_->landing_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - t0));
      metrics_->landing_batches->Increment();
    }
    return StartDecode(std::move(h), &sums[0]);
  }
  {
    absl::MutexLock l(&land_mu_);
    if (!land_stop_) {
      landings_.push_back({std::move(h), absl::Now()});
      return;
    }
  }
  // Stopped (a Decode after Stop): no lander any more.
  if (!NeedsLanding(h)) return StartDecode(std::move(h), nullptr);
  std::vector<absl::StatusOr<tandem::v1::StateChecksums>> sums = Land({ItemOf(h)});
  StartDecode(std::move(h), &sums[0]);
}

DecodeService::LandItem DecodeService::ItemOf(const Handoff& h) {
  const tandem::v1::StateChecksums& want =
      static_cast<const DecodeWaiter*>(h.waiter.get())->request.checksums();
  return {h.info, want.mla_layer_size() + want.kda_layer_size() > 0};
}

bool DecodeService::LandingReady() const { return land_stop_ || !landings_.empty(); }

bool DecodeService::NeedsLanding(const Handoff& h) const {
  return (staged_ && !h.info.landed_on_device) || ItemOf(h).checksums;
}

void DecodeService::LandLoop() {
  while (true) {
    std::vector<QueuedLanding> batch;
    {
      absl::MutexLock l(&land_mu_);
      land_mu_.Await(absl::Condition(this, &DecodeService::LandingReady));
      if (landings_.empty()) return;  // stopping, nothing left
      // Bounded by count and by prompt tokens: the pause holds up the running
      // requests' next step (a staged state copies its rows host -> device).
      int64_t tokens = 0;
      while (!landings_.empty() && batch.size() < kMaxLandingBatch) {
        const int64_t t = landings_.front().handoff.info.prompt_tokens;
        if (!batch.empty() && tokens + t > options_.max_landing_tokens) break;
        tokens += t;
        batch.push_back(std::move(landings_.front()));
        landings_.pop_front();
      }
      landings_taken_ += static_cast<int64_t>(batch.size());
    }
    // One pause of the engine for every state in the batch (a burst of
    // hand-offs waits one step, not one step each).
    std::vector<LandItem> items;
    std::vector<int> item_of(batch.size(), -1);
    for (size_t i = 0; i < batch.size(); ++i) {
      const Handoff& h = batch[i].handoff;
      if (!NeedsLanding(h)) continue;
      item_of[i] = static_cast<int>(items.size());
      items.push_back(ItemOf(h));
    }
    std::vector<absl::StatusOr<tandem::v1::StateChecksums>> sums;
    if (!items.empty()) sums = Land(std::move(items));
    if (metrics_ != nullptr) {
      const absl::Time now = absl::Now();
      for (const QueuedLanding& q : batch) {
        metrics_->landing_seconds->Observe(absl::ToDoubleSeconds(now - q.queued));
      }
      metrics_->landing_batches->Increment();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      StartDecode(std::move(batch[i].handoff),
                  item_of[i] >= 0 ? &sums[item_of[i]] : nullptr);
    }
  }
}

std::vector<absl::StatusOr<tandem::v1::StateChecksums>> DecodeService::Land(
    std::vector<LandItem> items) {
  using Result = absl::StatusOr<tandem::v1::StateChecksums>;
  auto stage_in = [this](const LandItem& item,
                         std::vector<kvtransfer::ByteRange>* out) -> absl::Status {
    for (int k = 0; k < tp() && staging_ != nullptr; ++k) {
      if (!regions_[k].staged) continue;
      const ReservationInfo& r = item.info;
      TANDEM_ASSIGN_OR_RETURN(
          std::vector<kvtransfer::ByteRange> ranges,
          worker::LandedRanges(*caches_[k], regions_[k], r.blocks, r.slot,
                               r.prompt_tokens, r.held_tokens));
      // Regions registered in place (auto where the agent took some) landed
      // on the device already.
      for (const kvtransfer::ByteRange& b : ranges) {
        if (staging_->IsStaged(b.region)) out->push_back(b);
      }
    }
    return absl::OkStatus();
  };
  auto staging_error = [](const ReservationInfo& r, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("request ", r.request_id,
                                               ": copying the landed state from host "
                                               "memory to the device: ",
                                               s.message()));
  };
  auto compute = [this, stage_in, staging_error](const std::vector<LandItem>& items) {
    std::vector<Result> results(items.size(), tandem::v1::StateChecksums());
    // Staged through host memory: what landed in the shadows goes to the
    // device first (the rows sent and the KDA slot; the held prefix stays),
    // every item's ranges in one copy batch. Not a state the sender wrote
    // straight into the device memory (IPC): its shadow never saw it.
    if (staging_ != nullptr) {
      std::vector<std::vector<kvtransfer::ByteRange>> per_item(items.size());
      std::vector<kvtransfer::ByteRange> all;
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].info.landed_on_device) continue;
        if (absl::Status s = stage_in(items[i], &per_item[i]); !s.ok()) {
          results[i] = staging_error(items[i].info, s);
          continue;
        }
        all.insert(all.end(), per_item[i].begin(), per_item[i].end());
      }
      if (absl::Status s = staging_->StageIn(all); !s.ok()) {
        // Which one: each alone (a bad item fails only itself).
        for (size_t i = 0; i < items.size(); ++i) {
          if (!results[i].ok()) continue;
          if (absl::Status one = staging_->StageIn(per_item[i]); !one.ok()) {
            results[i] = staging_error(items[i].info, one);
          }
        }
      }
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (!results[i].ok() || !items[i].checksums) continue;
      const ReservationInfo& r = items[i].info;
      std::vector<tandem::v1::StateChecksums> ranks;
      for (int k = 0; k < tp(); ++k) {
        const kvtransfer::RankLayout side =
            worker::CacheRankLayout(*caches_[k], regions_[k], r.blocks, r.slot);
        auto got =
            kvtransfer::ComputeChecksums(side, r.prompt_tokens, checksum_memory_[k]);
        if (!got.ok()) {
          results[i] = got.status();
          break;
        }
        ranks.push_back(std::move(*got));
      }
      if (results[i].ok()) results[i] = worker::MergeRankChecksums(ranks);
    }
    return results;
  };
  // Host memory: here, on this thread.
  if (hashers_.empty() && !staged_) return compute(items);
  // On the device: between two engine steps, so that the hashing and the
  // staging copies (allocations, launches) never meet a CUDA graph capture of
  // a step. The command owns its copy of the items: after a timeout here it
  // may still run.
  struct Shared {
    std::vector<LandItem> items;
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    std::vector<Result> results ABSL_GUARDED_BY(mu);
  };
  auto shared = std::make_shared<Shared>();
  shared->items = std::move(items);
  loop_->Post([shared, compute](engine::Engine& e) {
    // Not while an overlapped step runs on the device thread either.
    absl::Status quiet = e.Quiesce();
    std::vector<Result> v = quiet.ok()
                                ? compute(shared->items)
                                : std::vector<Result>(shared->items.size(), quiet);
    absl::MutexLock l(&shared->mu);
    shared->results = std::move(v);
    shared->done = true;
  });
  absl::MutexLock l(&shared->mu);
  // The bound grows with the batch: each state is staged in and hashed.
  const absl::Duration wait =
      kDeviceChecksumWait +
      absl::Milliseconds(500) * static_cast<int64_t>(shared->items.size() - 1);
  if (!shared->mu.AwaitWithTimeout(absl::Condition(&shared->done), wait)) {
    std::vector<Result> late;
    for (const LandItem& item : shared->items) {
      late.push_back(DeadlineExceeded(
          "request ", item.info.request_id,
          ": the landed state's staging and checksums on the device did not finish "
          "within ",
          absl::FormatDuration(wait), " (", shared->items.size(),
          " states landing together)"));
    }
    return late;
  }
  return std::move(shared->results);
}

void DecodeService::StartDecode(
    Handoff h, const absl::StatusOr<tandem::v1::StateChecksums>* landed) {
  std::shared_ptr<DecodeWaiter> w(static_cast<DecodeWaiter*>(h.waiter.release()));
  rpc::ResponseStream* stream = w->stream;
  const tandem::v1::DecodeRequest& req = w->request;
  const ReservationInfo& r = h.info;
  const std::string& id = r.request_id;
  auto fail = [&](const absl::Status& s, const char* outcome) {
    if (table_.Refuse(id, r.engine_id).free_now) FreeInEngine(r);
    Count("Decode", outcome);
    TLOG(WARNING, "decode refused").Kv("request_id", id).Kv("status", s);
    stream->Close(Grpc(s));
  };
  // The reserved blocks are not touched by the engine's steps: read them here.
  const tandem::v1::StateChecksums& want = req.checksums();
  const bool verified = want.mla_layer_size() + want.kda_layer_size() > 0;
  if (landed != nullptr) {
    if (!landed->ok()) return fail(landed->status(), "error");
    const tandem::v1::StateChecksums& got = **landed;
    if (absl::Status v = verified ? kvtransfer::Verify(want, got) : absl::OkStatus();
        !v.ok()) {
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
  // The blocks shared at Reserve belong to the prompt reserved: another one
  // here would decode on someone else's rows.
  if (r.prompt_fingerprint != 0 &&
      PromptFingerprint(req.prompt_token_ids()) != r.prompt_fingerprint) {
    return fail(
        InvalidArgument("request ", id, ": the prompt differs from the one reserved"),
        "invalid");
  }
  engine::ExportedState state;  // no ranges: the state is in the engine's blocks
  state.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  state.generated = {req.first_token_id()};
  state.num_cached_tokens = r.prompt_tokens;
  // What landed joins the cache (and is shared with later reservations) only
  // once verified: unchecked bytes would spoil every later turn, not one
  // request. Never more than the prompt, never negative (-1 means "all").
  state.cacheable_tokens =
      verified ? std::clamp<int64_t>(req.cacheable_prompt_tokens(), 0, r.prompt_tokens)
               : 0;
  // A structured-output grammar is compiled on the loop's compile thread
  // first (EngineLoop::CompileAhead), not at admission on the engine thread.
  loop_->CompileAhead(
      *std::move(params),
      [this, w, info = r, started = h.decode_started, state = std::move(state)](
          absl::StatusOr<engine::SamplingParams> compiled) mutable {
        loop_->Post([this, w, info = std::move(info), started, state = std::move(state),
                     compiled = std::move(compiled)](engine::Engine& e) {
          rpc::ResponseStream* stream = w->stream;
          const tandem::v1::DecodeRequest& req = w->request;
          const std::string& id = info.request_id;
          const engine::RequestId eid = info.engine_id;
          auto refuse = [&](const grpc::Status& s, const char* outcome) {
            table_.Refuse(id, eid);
            e.Abort(eid).IgnoreError();  // the reservation, on this thread
            Count("Decode", outcome);
            stream->Close(s);
          };
          // A cancel that came before this command found nothing to cancel.
          if (stream->cancelled()) return refuse(Cancelled(), "cancelled");
          if (!compiled.ok()) return refuse(Grpc(compiled.status()), "invalid");
          const engine::SamplingParams& params = *compiled;
          absl::StatusOr<engine::RequestOutput> out =
              e.AdmitReserved(eid, state, params);
          if (!out.ok()) {
            TLOG(WARNING, "admission failed")
                .Kv("request_id", id)
                .Kv("status", out.status());
            return refuse(Grpc(out.status()), "error");
          }
          tandem::v1::GenerateResponse m =
              worker::OutputToMessage(id, *out, req.return_text());
          if (params.logprobs && req.has_first_logprob()) {
            *m.add_logprobs() = req.first_logprob();
          }
          *m.mutable_prompt_logprobs() = req.prompt_logprobs();
          if (params.seed.has_value()) m.set_seed(*params.seed);
          if (metrics_ != nullptr) {
            metrics_->ttft->Observe(absl::ToDoubleSeconds(clock_->Now() - started));
          }
          TLOG(DEBUG, "decode admitted").Kv("request_id", id).Kv("engine_id", eid);
          if (out->finished) {  // the first token ended it; the reservation is freed
            table_.Finish(id, eid);
            m.mutable_usage()->set_prompt_tokens(info.prompt_tokens);
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
          so.prompt_tokens = info.prompt_tokens;
          so.return_text = req.return_text();
          so.rpc = "Decode";
          so.started = started;
          so.tokens_already_sent = 1;
          worker::OutputCallback inner =
              worker::StreamEngineOutputs(stream, metrics_, so);
          loop_->WatchOnLoopThread(
              eid,
              [this, id, eid, inner = std::move(inner)](
                  engine::Engine& e, const absl::StatusOr<engine::RequestOutput>& o) {
                if (!o.ok() || o->finished) table_.Finish(id, eid);  // FINISHED
                inner(e, o);
              });
        });
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
  engine::EnsureSeed(&*params);
  const engine::RequestId eid = next_engine_id_.fetch_add(1);
  std::vector<int32_t> prompt(req->prompt_token_ids().ids().begin(),
                              req->prompt_token_ids().ids().end());
  worker::EngineStreamOptions so;
  so.request_id = req->request_id();
  so.prompt_tokens = static_cast<int32_t>(prompt.size());
  so.return_text = req->return_text();
  so.seed = params->seed;
  so.rpc = "Generate";
  so.started = clock_->Now();
  // The request's prefix-cache namespace (its tenant): colocated requests hit
  // the decode worker's cache only within their salt.
  loop_->AddRequest(eid, std::move(prompt), *params,
                    worker::StreamEngineOutputs(stream, metrics_, so),
                    req->cache_salt());
  stream->SetOnCancel([this, eid, stream] {
    loop_->Cancel(eid, [this, stream] {
      Count("Generate", "cancelled");
      stream->Close(Cancelled());
    });
  });
  return stream;
}

grpc::ServerUnaryReactor* DecodeService::Release(grpc::CallbackServerContext* context,
                                                 const tandem::v1::ReleaseRequest* req,
                                                 tandem::v1::ReleaseResponse* resp) {
  Removal r = table_.Release(req->request_id());
  // An ADMITTED one is the engine's (its Decode runs): nothing to release.
  resp->set_found(r.found && r.was != ReservationState::kAdmitted);
  if (r.free_now) FreeInEngine(r.info);
  if (r.waiter != nullptr) {
    static_cast<DecodeWaiter*>(r.waiter.get())
        ->stream->Close(
            grpc::Status(grpc::StatusCode::ABORTED,
                         "the reservation was released before the state arrived"));
  }
  Count("Release", resp->found() ? "ok" : "not_found");
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::ResetPrefixCache(
    grpc::CallbackServerContext* context,
    const tandem::v1::WorkerResetPrefixCacheRequest*,
    tandem::v1::WorkerResetPrefixCacheResponse*) {
  Count("ResetPrefixCache", "ok");
  return worker::ResetPrefixCacheOnLoop(context, loop_);
}

void DecodeService::Tick(absl::Time now) {
  TickResult t = table_.Tick(now);
  for (const ReservationInfo& q : t.unquarantined) FreeInEngine(q);
  for (Removal& r : t.expired) {
    if (r.free_now) FreeInEngine(r.info);
    if (r.waiter != nullptr) {
      Count("Decode", "deadline_exceeded");
      static_cast<DecodeWaiter*>(r.waiter.get())
          ->stream->Close(Grpc(absl::DeadlineExceededError(absl::StrCat(
              "request ", r.info.request_id,
              ": the prefilled state did not arrive before the deadline"))));
    } else {
      TLOG(INFO, "reservation lease expired")
          .Kv("request_id", r.info.request_id)
          .Kv("state", ReservationStateName(r.was));
    }
  }
  if (metrics_ != nullptr) {
    // Reservations not yet admitted (RESERVED, LANDING, LANDED).
    metrics_->reservations->Set(
        static_cast<double>(table_.size() - table_.num_admitted()));
    metrics_->landing_blocks->Add({{"state", "used"}})
        .Set(static_cast<double>(table_.held_blocks()));
    metrics_->landing_blocks->Add({{"state", "free"}}).Set(loop_->stats().free_blocks);
  }
}

tandem::v1::WorkerLoad DecodeService::Load() const {
  // The engine's own counts (worker/worker_load.h).
  return worker::LoadOf(loop_->stats(), layout_.block_size());
}

}  // namespace tandem::decode
