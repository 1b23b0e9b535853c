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
  std::atomic<bool> cancel_requested{false};  // Cancel / client cancel seen
  tandem::v1::PrefillRequest request;
  std::vector<kvtransfer::RankLayout> dst;  // per rank
  absl::Time deadline;
  absl::Time started;
  engine::RequestId eid = 0;

  // The first caller wins; later ones do nothing.
  bool Finish(const grpc::Status& status) {
    if (finished.exchange(true)) return false;
    reactor->Finish(status);
    return true;
  }
};

// A request's layer-by-layer transfer; engine thread only, except `failed`
// (set by completion callbacks on the agent's thread).
struct PrefillService::Stream {
  std::shared_ptr<Call> call;
  std::vector<kvtransfer::PeerId> peers;     // per rank (usually one agent)
  std::vector<int64_t> rows;                 // per model layer: rows posted
  std::vector<kvtransfer::BatchId> batches;  // posted, not yet waited for
  // A chunk restarted below the rows already posted (the request was preempted
  // and recomputes): stop streaming; the whole state is sent after the prefill,
  // once every earlier batch has ended.
  bool restart = false;
  absl::Status post_error;  // the first plan or PostWrite failure
  std::shared_ptr<std::atomic<bool>> failed =
      std::make_shared<std::atomic<bool>>(false);
  uint64_t bytes = 0;
  int64_t segments = 0;
  absl::Time first_post = absl::InfiniteFuture();
};

// How long a cancelled batch may take to drain before its peer is dropped.
constexpr absl::Duration kDrainGrace = absl::Seconds(2);

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(
    worker::EngineLoop* loop, engine::KvCache* cache, kvtransfer::TransferAgent* agent,
    worker::WorkerMetrics* metrics, PrefillServiceOptions options) {
  return Create(loop, std::vector<engine::KvCache*>{cache}, agent, metrics,
                std::move(options));
}

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(
    worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
    kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
    PrefillServiceOptions options) {
  if (caches.empty()) return InvalidArgument("no caches");
  engine::KvCache* cache = caches[0];
  auto s = std::unique_ptr<PrefillService>(
      new PrefillService(loop, std::move(caches), agent, metrics, std::move(options)));
  // Every rank's buffers in the one agent (ranks are threads of this process).
  for (engine::KvCache* c : s->caches_) {
    TANDEM_ASSIGN_OR_RETURN(worker::CacheRegions r, worker::RegisterCache(agent, c));
    s->src_pools_.push_back(worker::CacheRankLayout(*c, r, {}, 0));
    s->regions_.push_back(std::move(r));
  }
  s->layout_ = worker::KvLayoutOf(*cache);
  int mla = 0, kda = 0;
  for (const model::LayerSpec& spec : cache->layers()) {
    if (spec.attention == model::AttentionKind::kKda) {
      s->layer_refs_.push_back({kvtransfer::LayerKind::kKda, kda++});
    } else {
      s->layer_refs_.push_back({kvtransfer::LayerKind::kMla, mla++});
    }
  }
  if (mla != cache->num_mla_layers() || kda != cache->num_kda_layers()) {
    return Internal("the cache's layer schedule has ", mla, " MLA and ", kda,
                    " KDA layers; its pools ", cache->num_mla_layers(), " and ",
                    cache->num_kda_layers());
  }
  if (s->options_.stream_layers) {
    PrefillService* self = s.get();
    loop->SetLayerProgressCallback(
        [self](int layer, absl::Span<const engine::LayerProgressEntry> entries) {
          self->OnLayer(layer, entries);
        });
  }
  return s;
}

PrefillService::~PrefillService() {
  for (auto& [eid, stream] : streams_) EndStream(stream.get());
}

PrefillService::PrefillService(worker::EngineLoop* loop,
                               std::vector<engine::KvCache*> caches,
                               kvtransfer::TransferAgent* agent,
                               worker::WorkerMetrics* metrics,
                               PrefillServiceOptions options)
    : loop_(loop),
      caches_(std::move(caches)),
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
  if (absl::Status h = loop_->health(); !h.ok()) {
    Count("Prefill", "unavailable");
    call->Finish(ToGrpcStatus(absl::UnavailableError(
        absl::StrCat("prefill worker ", options_.worker_id,
                     " is not taking work: its engine failed: ", h.message()))));
    return reactor;
  }
  if (req->target().ranks_size() != tp()) {
    return refuse(
        FailedPrecondition("the target has ", req->target().ranks_size(),
                           " ranks (decode TP size) but this prefill worker runs TP ",
                           tp(), ": prefill and decode TP sizes must be equal"));
  }
  for (int r = 0; r < tp(); ++r) {
    auto dst = worker::TargetRankLayout(req->target().ranks(r));
    if (!dst.ok()) return refuse(dst.status());
    absl::Status pair = kvtransfer::ValidatePair(src_pools_[r], *dst, 0);
    if (!pair.ok()) return refuse(pair);
    absl::Status one =
        kvtransfer::ValidateRankLayout(*dst, req->prompt_token_ids_size());
    if (!one.ok()) return refuse(one);
    call->dst.push_back(std::move(*dst));
  }
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
  if (options_.stream_layers) {
    // Connected before the prefill starts: the first layer posts at once.
    auto stream = std::make_unique<Stream>();
    for (int r = 0; r < tp(); ++r) {
      auto peer = PeerFor(req->target().ranks(r).transfer_descriptor());
      if (!peer.ok()) {
        done();
        const absl::Status s(
            peer.status().code(),
            absl::StrCat("cannot connect to the decode worker at ",
                         req->target().ranks(r).transfer_address(), " (rank ", r,
                         "): ", peer.status().message()));
        if (call->Finish(ToGrpcStatus(s))) {
          Count("Prefill", absl::StatusCodeToString(s.code()).c_str());
        }
        TLOG(WARNING, "prefill failed").Kv("request_id", id).Kv("status", s);
        return reactor;
      }
      stream->peers.push_back(*peer);
    }
    stream->call = call;
    stream->rows.assign(layer_refs_.size(), 0);
    loop_->Post([this, eid = call->eid,
                 stream = std::shared_ptr<Stream>(std::move(stream))](engine::Engine&) {
      streams_[eid] = std::make_unique<Stream>(std::move(*stream));
    });
  }
  std::vector<int32_t> prompt(req->prompt_token_ids().begin(),
                              req->prompt_token_ids().end());
  loop_->AddRequest(
      call->eid, std::move(prompt), *params,
      [this, call, done](engine::Engine& e,
                         const absl::StatusOr<engine::RequestOutput>& out) {
        absl::Status s = out.status();
        if (s.ok() && out->new_tokens.empty()) return;  // not the first token yet
        // The state must not move while it is read: stop the request before the
        // next step (commands run before it).
        loop_->Cancel(call->eid, nullptr);
        std::unique_ptr<Stream> stream = TakeStream(call->eid);
        if (s.ok()) s = Transfer(e, call.get(), *out, stream.get());
        // Every path: no batch reads the blocks once the request is aborted.
        if (stream != nullptr) EndStream(stream.get());
        done();  // after the transfer: a Cancel RPC can still stop its wait
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

void PrefillService::OnLayer(int layer,
                             absl::Span<const engine::LayerProgressEntry> entries) {
  for (const engine::LayerProgressEntry& en : entries) {
    auto it = streams_.find(en.id);
    if (it == streams_.end()) continue;
    Stream& st = *it->second;
    if (st.restart || !st.post_error.ok() || st.failed->load()) continue;
    if (layer < 0 || layer >= static_cast<int>(layer_refs_.size())) {
      st.post_error =
          Internal("layer progress for layer ", layer, " of ", layer_refs_.size());
      continue;
    }
    if (en.start_pos != st.rows[layer]) {
      // Recomputed from an earlier position (preempted): the rows posted so far
      // may have been read from blocks freed since. Stop streaming; Transfer
      // sends the whole state once every earlier batch has ended.
      st.restart = true;
      if (metrics_ != nullptr) metrics_->transfer_restarts->Increment();
      TLOG(INFO, "prefill recomputed; the transfer restarts after the prefill")
          .Kv("request_id", st.call->request.request_id())
          .Kv("layer", layer)
          .Kv("start_pos", en.start_pos)
          .Kv("rows_posted", st.rows[layer]);
      continue;
    }
    st.rows[layer] = en.end_pos;
    const kvtransfer::LayerRef ref = layer_refs_[layer];
    // A KDA slot is final only after the prompt's last chunk.
    if (ref.kind == kvtransfer::LayerKind::kKda && !en.completes_prefill) continue;
    // Every rank's rows of the layer to the same rank of the target (the
    // callback fires after the layer's all-reduce: final on every rank).
    for (int r = 0; r < tp() && st.post_error.ok(); ++r) {
      kvtransfer::RankLayout& src = src_pools_[r];
      src.block_ids.assign(en.block_table.begin(), en.block_table.end());
      src.state_slot = static_cast<int32_t>(en.slot);
      absl::StatusOr<kvtransfer::TransferPlan> plan = kvtransfer::PlanLayerRows(
          src, st.call->dst[r], ref, en.start_pos, en.end_pos);
      if (!plan.ok()) {
        st.post_error = plan.status();
        break;
      }
      if (plan->segments.empty()) continue;
      if (st.first_post == absl::InfiniteFuture()) st.first_post = absl::Now();
      std::shared_ptr<std::atomic<bool>> failed = st.failed;
      absl::StatusOr<kvtransfer::BatchId> batch =
          agent_->PostWrite(st.peers[r], plan->segments,
                            [failed](kvtransfer::BatchId, const absl::Status& s) {
                              if (!s.ok()) failed->store(true);
                            });
      if (!batch.ok()) {
        st.post_error = batch.status();
        break;
      }
      st.batches.push_back(*batch);
      st.bytes += plan->bytes;
      st.segments += static_cast<int64_t>(plan->segments.size());
      if (metrics_ != nullptr) metrics_->transfer_batches->Increment();
    }
  }
}

absl::Status PrefillService::WaitBatches(Stream* st, absl::Time deadline) {
  absl::Status first;
  for (kvtransfer::BatchId b : st->batches) {
    if (first.ok()) {
      // In slices, so that a cancelled call stops waiting at once.
      bool ended = false;
      while (true) {
        const absl::Time until =
            std::min(deadline, absl::Now() + absl::Milliseconds(20));
        first = agent_->Wait(b, until);
        if (!absl::IsDeadlineExceeded(first)) {
          ended = true;
          break;
        }
        if (until >= deadline) break;
        if (st->call->cancel_requested.load()) {
          first = absl::CancelledError("prefill cancelled");
          break;
        }
      }
      if (ended) continue;  // OK, or b failed (ended)
    }
    // After the first error: stop the batch and let it drain.
    agent_->Cancel(b).IgnoreError();
    const absl::Status d = agent_->Wait(b, absl::Now() + kDrainGrace);
    if (absl::IsDeadlineExceeded(d)) {
      TLOG(WARNING, "a cancelled batch did not drain; dropping the peer")
          .Kv("request_id", st->call->request.request_id());
      // Ends their in-flight batches.
      for (size_t r = 0; r < st->peers.size(); ++r) {
        if (std::find(st->peers.begin(), st->peers.begin() + r, st->peers[r]) ==
            st->peers.begin() + r) {
          DropPeer(st->peers[r]);
        }
      }
    }
  }
  st->batches.clear();
  return first;
}

void PrefillService::EndStream(Stream* st) {
  if (st->batches.empty()) return;
  for (kvtransfer::BatchId b : st->batches) agent_->Cancel(b).IgnoreError();
  WaitBatches(st, absl::Now() + kDrainGrace).IgnoreError();
}

std::unique_ptr<PrefillService::Stream> PrefillService::TakeStream(
    engine::RequestId eid) {
  auto it = streams_.find(eid);
  if (it == streams_.end()) return nullptr;
  std::unique_ptr<Stream> st = std::move(it->second);
  streams_.erase(it);
  return st;
}

absl::Status PrefillService::Transfer(engine::Engine& e, Call* call,
                                      const engine::RequestOutput& out,
                                      Stream* stream) {
  const tandem::v1::PrefillRequest& req = call->request;
  const int64_t n = req.prompt_token_ids_size();
  const absl::Time computed = absl::Now();
  if (call->finished.load()) return absl::CancelledError("prefill cancelled");
  TANDEM_ASSIGN_OR_RETURN(engine::StateLocation loc, e.Locate(call->eid));
  if (loc.num_cached_tokens != n) {
    return Internal("request ", req.request_id(), ": ", loc.num_cached_tokens,
                    " cached tokens after prefill, expected ", n);
  }
  // Per rank: the sequence in the rank's cache, its whole-state plan to the
  // target's same rank, its checksums.
  std::vector<kvtransfer::TransferPlan> plans;
  std::vector<tandem::v1::StateChecksums> sums;
  for (int r = 0; r < tp(); ++r) {
    const kvtransfer::RankLayout src = worker::CacheRankLayout(
        *caches_[r], regions_[r], loc.block_ids, static_cast<int32_t>(loc.slot));
    TANDEM_ASSIGN_OR_RETURN(kvtransfer::TransferPlan plan,
                            kvtransfer::PlanAll(src, call->dst[r], n));
    plans.push_back(std::move(plan));
    // With streaming, the last batches are in flight while the checksums run.
    if (req.checksums()) {
      TANDEM_ASSIGN_OR_RETURN(
          tandem::v1::StateChecksums c,
          kvtransfer::ComputeChecksums(
              src, n, worker::CacheRegionBytes(caches_[r], regions_[r])));
      sums.push_back(std::move(c));
    }
  }
  tandem::v1::PrefillResponse* resp = call->response;
  if (req.checksums()) *resp->mutable_checksums() = worker::MergeRankChecksums(sums);
  // Streamed: every layer must have had all its rows posted; otherwise (or when
  // recomputed) the whole state goes now.
  bool whole = stream == nullptr || stream->restart;
  if (!whole) {
    for (int64_t rows : stream->rows) {
      if (rows != n) {
        TLOG(WARNING, "a layer was not fully streamed; sending the whole state")
            .Kv("request_id", req.request_id())
            .Kv("rows", rows)
            .Kv("prompt_tokens", n);
        whole = true;
        break;
      }
    }
  }
  std::vector<kvtransfer::PeerId> peers;
  if (stream != nullptr) {
    peers = stream->peers;
  } else {
    for (int r = 0; r < tp(); ++r) {
      TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId p,
                              PeerFor(req.target().ranks(r).transfer_descriptor()));
      peers.push_back(p);
    }
  }
  const kvtransfer::PeerId peer = peers[0];  // the notification goes to rank 0's
  absl::Time first_post = absl::InfiniteFuture();
  uint64_t sent_bytes = 0;
  int64_t sent_segments = 0;
  int64_t sent_batches = 0;
  absl::Status s;
  if (stream != nullptr) {
    first_post = stream->first_post;
    sent_bytes = stream->bytes;
    sent_segments = stream->segments;
    sent_batches = static_cast<int64_t>(stream->batches.size());
    // Also when restarting: the earlier batches end before anything is rewritten.
    // After a failed post the caller's EndStream cancels the rest instead.
    s = stream->post_error;
    if (s.ok()) s = WaitBatches(stream, call->deadline);
  }
  auto post_and_wait = [&](kvtransfer::PeerId to,
                           absl::Span<const kvtransfer::Segment> segments) {
    if (first_post == absl::InfiniteFuture()) first_post = absl::Now();
    absl::StatusOr<kvtransfer::BatchId> batch = agent_->PostWrite(to, segments);
    if (!batch.ok()) return batch.status();
    ++sent_batches;
    if (metrics_ != nullptr) metrics_->transfer_batches->Increment();
    for (const kvtransfer::Segment& g : segments) sent_bytes += g.length;
    sent_segments += static_cast<int64_t>(segments.size());
    absl::Status w = agent_->Wait(*batch, call->deadline);
    if (!w.ok()) {
      agent_->Cancel(*batch).IgnoreError();
      if (absl::IsDeadlineExceeded(w) &&
          absl::IsDeadlineExceeded(agent_->Wait(*batch, absl::Now() + kDrainGrace))) {
        DropPeer(to);
      }
    }
    return w;
  };
  if (s.ok() && options_.test_corrupt_transfer && !plans[0].segments.empty()) {
    // TEST ONLY: damage the first byte rank 0's plan sends (after the
    // checksums); a streamed state has it sent again.
    const kvtransfer::Segment& s0 = plans[0].segments.front();
    absl::Span<const uint8_t> region =
        worker::CacheRegionBytes(caches_[0], regions_[0])(s0.local_region);
    const_cast<uint8_t*>(region.data())[s0.local_offset] ^= 0x5A;
    TLOG(WARNING, "TEST ONLY: corrupted one byte of the transfer")
        .Kv("request_id", req.request_id());
    if (!whole) s = post_and_wait(peers[0], absl::MakeConstSpan(&s0, 1));
  }
  for (int r = 0; r < tp() && s.ok() && whole; ++r) {
    s = post_and_wait(peers[r], plans[r].segments);
  }
  const absl::Time landed = absl::Now();
  if (s.ok()) {
    s = agent_->Notify(peer, req.request_id(), "", call->deadline);
  }
  if (first_post == absl::InfiniteFuture()) first_post = landed;
  const double secs = absl::ToDoubleSeconds(landed - first_post);
  const double exposed = absl::ToDoubleSeconds(landed - computed);
  tandem::v1::TransferStats* ts = resp->mutable_transfer();
  ts->set_status(TransferStatusOf(s));
  ts->set_bytes(static_cast<int64_t>(sent_bytes));
  ts->set_segments(static_cast<int32_t>(sent_segments));
  ts->set_seconds(secs);
  ts->set_transport(agent_->Transport(peer));
  if (metrics_ != nullptr) {
    metrics_->transfers->Add({{"outcome", s.ok() ? "ok" : "error"}}).Increment();
    if (s.ok()) {
      metrics_->transfer_bytes->Increment(static_cast<double>(sent_bytes));
      metrics_->transfer_seconds->Increment(secs);
      metrics_->exposed_transfer_seconds->Observe(exposed);
    }
    metrics_->prefill_seconds->Observe(absl::ToDoubleSeconds(computed - call->started));
  }
  if (!s.ok()) {
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
      for (size_t r = 0; r < peers.size(); ++r) {
        if (std::find(peers.begin(), peers.begin() + r, peers[r]) ==
            peers.begin() + r) {
          DropPeer(peers[r]);
        }
      }
    }
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
      .Kv("streamed", !whole)
      .Kv("batches", sent_batches)
      .Kv("bytes", sent_bytes)
      .Kv("segments", sent_segments)
      .Kv("transfer_s", secs)
      .Kv("exposed_s", exposed);
  return absl::OkStatus();
}

void PrefillService::CancelCall(std::shared_ptr<Call> call) {
  call->cancel_requested.store(true);  // seen by a wait for the stream's batches
  // One command: the stream's batches end before the request (and its blocks)
  // goes, and no step runs in between.
  loop_->Post([this, call](engine::Engine& e) {
    std::unique_ptr<Stream> stream = TakeStream(call->eid);
    if (stream != nullptr) EndStream(stream.get());
    if (!loop_->CancelOnLoopThread(e, call->eid)) return;
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
