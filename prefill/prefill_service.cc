#include "prefill/prefill_service.h"

#include <algorithm>
#include <utility>

#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/media/preprocess.h"
#include "engine/sampling/proto_convert.h"
#include "engine/sampling/sampling_params.h"
#include "kvtransfer/plan.h"
#include "rpc/deadline.h"
#include "worker/prefix_cache_reset.h"
#include "worker/worker_load.h"

namespace tandem::prefill {
namespace {

// The request's images decoded and preprocessed with the gateway's code, each
// checked against what the gateway found (the same bytes must give the same
// patches: engine/media is deterministic and bit-exact).
absl::StatusOr<std::vector<media::PatchedImage>> PrepareImages(
    const tandem::v1::PrefillRequest& req, const vision::VisionTower& tower,
    const media::DecodeLimits& limits) {
  media::MediaConfig config;
  config.patch_size = static_cast<int>(tower.config().patch_size);
  if (!tower.config().merge_kernel_size.empty()) {
    config.merge_kernel = tower.config().merge_kernel_size[0];
  }
  std::vector<media::PatchedImage> out;
  int64_t end = 0;
  for (int i = 0; i < req.images_size(); ++i) {
    const tandem::v1::ImageInput& im = req.images(i);
    absl::StatusOr<media::DecodedImage> decoded =
        media::DecodeImage(im.data(), im.mime_type(), limits);
    if (!decoded.ok()) {
      return InvalidArgument("images[", i, "]: ", decoded.status().message());
    }
    absl::StatusOr<media::PatchedImage> p = media::Preprocess(*decoded, config);
    if (!p.ok()) return InvalidArgument("images[", i, "]: ", p.status().message());
    if (p->grid_h != im.grid_h() || p->grid_w != im.grid_w() ||
        p->num_tokens() != im.num_tokens() || p->content_hash != im.content_hash()) {
      return InvalidArgument(
          "images[", i, "]: the prefill worker's preprocessing gives grid ", p->grid_h,
          "x", p->grid_w, ", ", p->num_tokens(), " tokens, hash ", p->content_hash,
          "; the request says grid ", im.grid_h(), "x", im.grid_w(), ", ",
          im.num_tokens(), " tokens, hash ", im.content_hash(),
          " (gateway and prefill worker disagree on the image or its preprocessing)");
    }
    if (im.placeholder_start() < end ||
        im.placeholder_start() + im.num_tokens() > req.prompt_token_ids_size()) {
      return InvalidArgument("images[", i, "]: placeholders [", im.placeholder_start(),
                             ", ", im.placeholder_start() + im.num_tokens(),
                             ") are outside the prompt or overlap the previous image");
    }
    end = im.placeholder_start() + im.num_tokens();
    out.push_back(*std::move(p));
  }
  return out;
}

class PrefillReactor final : public grpc::ServerUnaryReactor {
 public:
  std::function<void()> on_cancel;
  void OnCancel() override {
    if (on_cancel) on_cancel();
  }
  void OnDone() override { delete this; }
};

}  // namespace

// One Prefill RPC: its reactor and response, and the request's SendSession.
struct PrefillService::Call {
  PrefillReactor* reactor = nullptr;                // valid until finished
  tandem::v1::PrefillResponse* response = nullptr;  // owned by gRPC, same
  std::atomic<bool> finished{false};
  // Set by CancelCall before its command is posted: an image request still at
  // the tower then never reaches the engine.
  std::atomic<bool> cancelled{false};
  tandem::v1::PrefillRequest request;
  engine::RequestId eid = 0;
  // Set before the call is visible to Cancel; engine thread only, except its
  // thread-safe Cancel().
  std::shared_ptr<SendSession> session;

  // The first caller wins; later ones do nothing.
  bool Finish(const grpc::Status& status) {
    if (finished.exchange(true)) return false;
    reactor->Finish(status);
    return true;
  }
};

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
  for (size_t t = 0; t < options.vision.size(); ++t) {
    if (options.vision[t] == nullptr)
      return InvalidArgument("vision tower ", t, " is null");
  }
  engine::KvCache* cache = caches[0];
  auto s = std::unique_ptr<PrefillService>(
      new PrefillService(loop, std::move(caches), agent, metrics, std::move(options)));
  // Every rank's buffers in the one agent (ranks are threads of this process).
  for (engine::KvCache* c : s->caches_) {
    TANDEM_ASSIGN_OR_RETURN(worker::CacheRegions r, worker::RegisterCache(agent, c));
    s->regions_.push_back(std::move(r));
  }
  const std::vector<kernels::Backend*>& devices = s->options_.checksum_backends;
  if (!devices.empty() && devices.size() != s->caches_.size()) {
    return InvalidArgument(devices.size(), " checksum backends for ", s->caches_.size(),
                           " ranks");
  }
  for (size_t r = 0; r < s->caches_.size(); ++r) {
    SendSource source{worker::CacheRankLayout(*s->caches_[r], s->regions_[r], {}, 0),
                      worker::CacheRegionBytes(s->caches_[r], s->regions_[r])};
    if (!devices.empty()) {
      if (devices[r] == nullptr)
        return InvalidArgument("checksum backend ", r, " is null");
      s->hashers_.push_back(std::make_unique<worker::BackendChunkHasher>(devices[r]));
      kvtransfer::ChecksumMemory m =
          worker::CacheChecksumMemory(s->caches_[r], s->regions_[r],
                                      s->hashers_.back().get(), devices[r]->device());
      source.bytes = std::move(m.regions);
      source.hasher = m.hasher;
      source.host_addressable = m.host_addressable;
    }
    s->send_.sources.push_back(std::move(source));
  }
  if (!devices.empty()) {
    TLOG(INFO, "state checksums computed on the device")
        .Kv("backend", devices[0]->name())
        .Kv("device", devices[0]->device().name())
        .Kv("tp_ranks", devices.size());
  }
  s->layout_ = worker::KvLayoutOf(*cache);
  int mla = 0, kda = 0;
  for (const model::LayerSpec& spec : cache->layers()) {
    if (spec.attention == model::AttentionKind::kKda) {
      s->send_.layers.push_back({kvtransfer::LayerKind::kKda, kda++});
    } else {
      s->send_.layers.push_back({kvtransfer::LayerKind::kMla, mla++});
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
  for (size_t t = 0; t < s->options_.vision.size(); ++t) {
    // Each tower's series exported from the start (zero until an image).
    if (s->metrics_ != nullptr) {
      s->metrics_->vision_encode_seconds->Add({{"tower", absl::StrCat(t)}});
    }
    PrefillService* self = s.get();
    s->encoders_.emplace_back([self, t] { self->EncoderLoop(static_cast<int>(t)); });
  }
  return s;
}

PrefillService::~PrefillService() {
  StopEncoding();
  for (auto& [eid, session] : sessions_) session->End();
}

void PrefillService::StopEncoding() {
  std::deque<EncodeJob> dropped;
  {
    absl::MutexLock l(&encode_mu_);
    encode_stop_ = true;
    dropped.swap(encode_jobs_);
  }
  for (std::thread& t : encoders_) {
    if (t.joinable()) t.join();
  }
  for (EncodeJob& job : dropped) job(nullptr, -1);
}

void PrefillService::EncoderLoop(int t) {
  for (;;) {
    EncodeJob job;
    {
      absl::MutexLock l(&encode_mu_);
      encode_mu_.Await(absl::Condition(
          +[](PrefillService* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->encode_mu_) {
            return s->encode_stop_ || !s->encode_jobs_.empty();
          },
          this));
      if (encode_jobs_.empty()) return;  // stopping
      job = std::move(encode_jobs_.front());
      encode_jobs_.pop_front();
      if (metrics_ != nullptr) {
        metrics_->vision_queue->Set(static_cast<double>(encode_jobs_.size()));
      }
    }
    job(options_.vision[t], t);
  }
}

void PrefillService::EndBeforeEngine(Call* call, const grpc::Status& status,
                                     const char* outcome) {
  sessions_.erase(call->eid);
  call->session->End();
  {
    absl::MutexLock l(&mu_);
    active_.erase(call->request.request_id());
  }
  if (call->Finish(status)) Count("Prefill", outcome);
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
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      peers_(agent) {
  send_.agent = agent_;
  send_.peers = &peers_;
  send_.clock = clock_;
  send_.metrics = metrics_;
  send_.test_corrupt_transfer = options_.test_corrupt_transfer;
}

void PrefillService::Count(const char* rpc, const char* outcome) {
  if (metrics_ != nullptr) metrics_->CountRequest(rpc, outcome);
}

grpc::ServerUnaryReactor* PrefillService::Prefill(grpc::CallbackServerContext* context,
                                                  const tandem::v1::PrefillRequest* req,
                                                  tandem::v1::PrefillResponse* resp) {
  auto* reactor = new PrefillReactor();
  auto call = std::make_shared<Call>();
  call->reactor = reactor;
  call->response = resp;
  call->request = *req;
  // The call's and the message's deadline; default_deadline only when neither
  // carries one (a cap would cut every prefill longer than it: a 64k-token
  // prompt takes minutes on a CPU).
  absl::Time deadline =
      rpc::WithUnixMillis(rpc::ContextDeadline(*context), req->deadline_unix_ms());
  if (deadline == absl::InfiniteFuture()) {
    deadline = clock_->Now() + options_.default_deadline;
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
  SendSpec spec;
  spec.request_id = req->request_id();
  spec.num_tokens = req->prompt_token_ids_size();
  spec.stream_layers = options_.stream_layers;
  spec.checksums = req->checksums();
  spec.deadline = deadline;
  spec.reservation_token = req->target().reservation_token();
  // A decode-side prefix hit: those rows are there already (whole blocks of
  // the target, inside the prompt).
  const int64_t held = req->target().cached_prefix_tokens();
  if (held < 0 || held > req->prompt_token_ids_size()) {
    return refuse(InvalidArgument("the target holds ", held,
                                  " cached prompt tokens of a prompt of ",
                                  req->prompt_token_ids_size()));
  }
  if (held > 0 && !options_.write_after_held_prefix) {
    return refuse(FailedPrecondition(
        "the target holds ", held,
        " cached prompt tokens (a decode-side prefix hit) "
        "but prefill worker ",
        options_.worker_id,
        " does not write after held rows (--kv_write_after_held_prefix=false) and "
        "did not register writes_after_held_prefix: writing every row would "
        "overwrite blocks the decode worker shares; the router must not share "
        "blocks for it (ReserveRequest.share_held_prefix)"));
  }
  spec.held_tokens = held;
  for (int r = 0; r < tp(); ++r) {
    const tandem::v1::RankTarget& t = req->target().ranks(r);
    auto dst = worker::TargetRankLayout(t);
    if (!dst.ok()) return refuse(dst.status());
    absl::Status pair = kvtransfer::ValidatePair(send_.sources[r].pools, *dst, 0);
    if (!pair.ok()) return refuse(pair);
    absl::Status one =
        kvtransfer::ValidateRankLayout(*dst, req->prompt_token_ids_size());
    if (!one.ok()) return refuse(one);
    if (held % std::max(1, dst->layout.block_size()) != 0) {
      return refuse(InvalidArgument("the target's ", held,
                                    " cached prompt tokens are not whole blocks of ",
                                    dst->layout.block_size(), " tokens"));
    }
    spec.targets.push_back(
        {std::move(*dst), t.transfer_descriptor(), t.transfer_address()});
  }
  std::shared_ptr<std::vector<media::PatchedImage>> images;
  if (req->images_size() > 0) {
    if (options_.vision.empty()) {
      return refuse(FailedPrecondition(
          "prefill worker ", options_.worker_id,
          " has no vision tower (its checkpoint has no vision tensors, or its backend "
          "cannot run the tower): a prompt with images cannot be prefilled here"));
    }
    absl::StatusOr<std::vector<media::PatchedImage>> prepared =
        PrepareImages(*req, *options_.vision[0], options_.decode_limits);
    if (!prepared.ok()) return refuse(prepared.status());
    images = std::make_shared<std::vector<media::PatchedImage>>(*std::move(prepared));
  }
  // Prefill-only parameters: the request's sampling; stop conditions are the
  // decode worker's business (the router sends requests with min_tokens > 0 to
  // the colocated path, so no stop token is masked at the first token).
  auto params = engine::SamplingParamsFromProto(req->sampling(), {});
  if (!params.ok()) return refuse(params.status());
  params->ignore_eos = true;
  params->max_tokens = 0;
  engine::EnsureSeed(&*params);
  if (params->seed.has_value()) resp->set_seed(*params->seed);
  const std::string id = req->request_id();
  {
    absl::MutexLock l(&mu_);
    if (active_.contains(id)) {
      return refuse(absl::AlreadyExistsError(
          absl::StrCat("request ", id, " is already being prefilled")));
    }
  }
  // Streaming: connected before the prefill starts, so the first layer posts
  // at once.
  absl::StatusOr<std::unique_ptr<SendSession>> session =
      SendSession::Create(&send_, std::move(spec));
  if (!session.ok()) {
    if (call->Finish(ToGrpcStatus(session.status()))) {
      Count("Prefill", absl::StatusCodeToString(session.status().code()).c_str());
    }
    TLOG(WARNING, "prefill failed").Kv("request_id", id).Kv("status", session.status());
    return reactor;
  }
  call->session = std::move(*session);
  call->eid = next_engine_id_.fetch_add(1);
  {
    absl::MutexLock l(&mu_);
    if (active_.contains(id)) {
      return refuse(absl::AlreadyExistsError(
          absl::StrCat("request ", id, " is already being prefilled")));
    }
    active_[id] = call;
  }
  auto done = [this, id] {
    absl::MutexLock l(&mu_);
    active_.erase(id);
  };
  std::weak_ptr<Call> weak = call;
  reactor->on_cancel = [this, weak] {
    if (auto c = weak.lock()) CancelCall(c);
  };
  if (options_.stream_layers) {
    loop_->Post([this, eid = call->eid, session = call->session](engine::Engine&) {
      sessions_[eid] = session;
    });
  }
  std::vector<int32_t> prompt(req->prompt_token_ids().begin(),
                              req->prompt_token_ids().end());
  worker::OutputCallback on_output =
      [this, call, done](engine::Engine& e,
                         const absl::StatusOr<engine::RequestOutput>& out) {
        absl::Status s = out.status();
        if (s.ok() && out->new_tokens.empty()) return;  // not the first token yet
        // The state must not move while it is read: stop the request before the
        // next step (commands run before it).
        loop_->Cancel(call->eid, nullptr);
        sessions_.erase(call->eid);
        if (s.ok()) s = FinishTransfer(e, call.get(), *out);
        // Every path: no batch reads the blocks once the request is aborted.
        call->session->End();
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
      };
  // The request's prefix-cache namespace (its tenant), as the router passed it.
  if (images == nullptr) {
    loop_->AddRequest(call->eid, std::move(prompt), *params, std::move(on_output),
                      req->cache_salt());
    return reactor;
  }
  // The tower runs on the encoder thread (the engine keeps stepping
  // meanwhile), then the request is added on the engine thread with one
  // MediaInput per image, unless it was cancelled while it waited.
  EncodeJob job = [this, call, images, prompt = std::move(prompt), params = *params,
                   on_output = std::move(on_output)](vision::VisionTower* tower,
                                                     int index) mutable {
    if (tower == nullptr) {
      // Stopping: ended here, not through the loop (which may run no more
      // commands); its session entry, if any, ends with the service.
      call->session->Cancel();
      {
        absl::MutexLock l(&mu_);
        active_.erase(call->request.request_id());
      }
      if (call->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                    "the prefill worker is shutting down"))) {
        Count("Prefill", "UNAVAILABLE");
      }
      return;
    }
    std::shared_ptr<std::vector<engine::MediaInput>> media;
    absl::Status encoded;
    if (!call->cancelled.load()) {
      std::vector<const media::PatchedImage*> ptrs;
      for (const media::PatchedImage& p : *images) ptrs.push_back(&p);
      const absl::Time start = absl::Now();
      absl::StatusOr<std::vector<float>> rows = tower->Encode(ptrs);
      if (metrics_ != nullptr) {
        metrics_->vision_encode_seconds->Add({{"tower", absl::StrCat(index)}})
            .Observe(absl::ToDoubleSeconds(absl::Now() - start));
      }
      if (rows.ok()) {
        const int64_t hidden = tower->config().text_hidden_size;
        media = std::make_shared<std::vector<engine::MediaInput>>();
        int64_t offset = 0;
        for (int i = 0; i < call->request.images_size(); ++i) {
          const tandem::v1::ImageInput& im = call->request.images(i);
          const int64_t n = (*images)[i].num_tokens();
          auto emb = std::make_shared<std::vector<float>>(
              rows->begin() + offset * hidden, rows->begin() + (offset + n) * hidden);
          offset += n;
          media->push_back({.position = im.placeholder_start(),
                            .rows = n,
                            .content_hash = im.content_hash(),
                            .embeddings = std::move(emb)});
        }
      } else {
        encoded = absl::InternalError(
            absl::StrCat("the vision tower failed: ", rows.status().message()));
      }
    }
    // On the engine thread, ordered with CancelCall's command: a cancel seen
    // here ends the call; one after the add finds the request in the engine.
    loop_->Post([this, call, encoded, media, prompt = std::move(prompt), params,
                 on_output = std::move(on_output)](engine::Engine& e) mutable {
      if (call->cancelled.load()) {
        EndBeforeEngine(call.get(),
                        grpc::Status(grpc::StatusCode::CANCELLED, "prefill cancelled"),
                        "cancelled");
        return;
      }
      if (!encoded.ok()) {
        on_output(e, encoded);
        return;
      }
      // Known to the loop when this returns: a cancel posted meanwhile (queued
      // behind this command) finds it.
      loop_->AddRequestOnLoopThread(e, call->eid, std::move(prompt), params,
                                    std::move(on_output), call->request.cache_salt(),
                                    std::move(*media));
    });
  };
  {
    absl::MutexLock l(&encode_mu_);
    if (!encode_stop_) {
      encode_jobs_.push_back(std::move(job));
      if (metrics_ != nullptr) {
        metrics_->vision_queue->Set(static_cast<double>(encode_jobs_.size()));
      }
      return reactor;
    }
  }
  job(nullptr, -1);
  return reactor;
}

void PrefillService::OnLayer(int layer,
                             absl::Span<const engine::LayerProgressEntry> entries) {
  for (const engine::LayerProgressEntry& en : entries) {
    auto it = sessions_.find(en.id);
    if (it == sessions_.end()) continue;
    it->second->OnLayer(layer, {.start = en.start_pos,
                                .end = en.end_pos,
                                .block_table = en.block_table,
                                .slot = static_cast<int32_t>(en.slot),
                                .completes_prefill = en.completes_prefill});
  }
}

absl::Status PrefillService::FinishTransfer(engine::Engine& e, Call* call,
                                            const engine::RequestOutput& out) {
  SendSession& session = *call->session;
  TANDEM_ASSIGN_OR_RETURN(engine::StateLocation loc, e.Locate(call->eid));
  session.Computed({.block_ids = loc.block_ids,
                    .slot = static_cast<int32_t>(loc.slot),
                    .num_cached_tokens = loc.num_cached_tokens});
  TANDEM_RETURN_IF_ERROR(session.Run());
  const tandem::v1::PrefillRequest& req = call->request;
  tandem::v1::PrefillResponse* resp = call->response;
  const SendStats& st = session.stats();
  if (req.checksums()) *resp->mutable_checksums() = session.checksums();
  tandem::v1::TransferStats* ts = resp->mutable_transfer();
  ts->set_status(tandem::v1::TRANSFER_STATUS_OK);
  ts->set_bytes(static_cast<int64_t>(st.bytes));
  ts->set_segments(static_cast<int32_t>(st.segments));
  ts->set_seconds(absl::ToDoubleSeconds(st.transfer));
  ts->set_transport(st.transport);
  resp->set_request_id(req.request_id());
  resp->set_first_token_id(out.new_tokens.front());
  if (!out.logprobs.empty()) {
    engine::SampleResultToProto(out.logprobs.front(), resp->mutable_first_logprob());
  }
  for (const engine::SampleResult& p : out.prompt_logprobs) {
    engine::SampleResultToProto(p, resp->add_prompt_logprobs());
  }
  resp->set_prefill_seconds(absl::ToDoubleSeconds(st.prefill));
  resp->set_cached_prompt_tokens(static_cast<int32_t>(out.cached_prompt_tokens));
  resp->set_aligned_prompt_tokens(static_cast<int32_t>(loc.aligned_tokens));
  return absl::OkStatus();
}

void PrefillService::CancelCall(std::shared_ptr<Call> call) {
  call->cancelled.store(true);  // an image request at the tower stops there
  call->session->Cancel();      // seen by the session's wait at the first token
  // One command: the session's batches end before the request (and its blocks)
  // goes, and no step runs in between.
  loop_->Post([this, call](engine::Engine& e) {
    sessions_.erase(call->eid);
    call->session->End();
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

grpc::ServerUnaryReactor* PrefillService::ResetPrefixCache(
    grpc::CallbackServerContext* context,
    const tandem::v1::WorkerResetPrefixCacheRequest*,
    tandem::v1::WorkerResetPrefixCacheResponse*) {
  Count("ResetPrefixCache", "ok");
  return worker::ResetPrefixCacheOnLoop(context, loop_);
}

tandem::v1::WorkerLoad PrefillService::Load() const {
  // The engine's own counts (worker/worker_load.h).
  return worker::LoadOf(loop_->stats(), layout_.block_size());
}

}  // namespace tandem::prefill
