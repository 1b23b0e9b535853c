#include "prefill/send_session.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"
#include "common/status.h"
#include "worker/cache_layout.h"

namespace tandem::prefill {

absl::string_view SendStateName(SendState state) {
  switch (state) {
    case SendState::kComputing:
      return "COMPUTING";
    case SendState::kStreaming:
      return "STREAMING";
    case SendState::kRestarted:
      return "RESTARTED";
    case SendState::kDraining:
      return "DRAINING";
    case SendState::kFinishing:
      return "FINISHING";
    case SendState::kDone:
      return "DONE";
    case SendState::kCancelled:
      return "CANCELLED";
    case SendState::kFailed:
      return "FAILED";
  }
  return "UNKNOWN";
}

absl::StatusOr<std::unique_ptr<SendSession>> SendSession::Create(
    const SendContext* context, SendSpec spec) {
  if (context == nullptr || context->agent == nullptr || context->peers == nullptr ||
      context->clock == nullptr) {
    return InvalidArgument("send context without agent, peer cache or clock");
  }
  if (spec.targets.size() != context->sources.size()) {
    return InvalidArgument("request ", spec.request_id, ": ", spec.targets.size(),
                           " target ranks for ", context->sources.size(),
                           " source ranks");
  }
  if (spec.num_tokens <= 0) {
    return InvalidArgument("request ", spec.request_id, ": no tokens to send");
  }
  if (spec.held_tokens < 0 || spec.held_tokens > spec.num_tokens) {
    return InvalidArgument("request ", spec.request_id, ": the decode worker holds ",
                           spec.held_tokens, " tokens of a prompt of ",
                           spec.num_tokens);
  }
  auto s = std::unique_ptr<SendSession>(new SendSession(context, std::move(spec)));
  if (s->spec_.stream_layers) TANDEM_RETURN_IF_ERROR(s->ConnectAll());
  return s;
}

SendSession::SendSession(const SendContext* context, SendSpec spec)
    : context_(context), spec_(std::move(spec)) {
  started_ = context_->clock->Now();
  // The rows the decode worker holds count as sent.
  rows_.assign(context_->layers.size(), spec_.held_tokens);
  chunk_end_.assign(context_->layers.size(), -1);
  for (const SendSource& src : context_->sources) sources_.push_back(src.pools);
}

SendSession::~SendSession() { End(); }

bool SendSession::Live() const {
  return state_ != SendState::kDone && state_ != SendState::kCancelled &&
         state_ != SendState::kFailed;
}

absl::Status SendSession::ConnectAll() {
  peers_.clear();
  for (size_t r = 0; r < spec_.targets.size(); ++r) {
    absl::StatusOr<kvtransfer::PeerId> peer =
        context_->peers->Get(spec_.targets[r].descriptor);
    if (!peer.ok()) {
      peers_.clear();
      return absl::Status(peer.status().code(),
                          absl::StrCat("cannot connect to the decode worker at ",
                                       spec_.targets[r].address, " (rank ", r,
                                       "): ", peer.status().message()));
    }
    peers_.push_back(*peer);
  }
  return absl::OkStatus();
}

void SendSession::Cancel() { cancel_requested_.store(true); }

void SendSession::ObserveCancelAndFailures() {
  if (!Live()) return;
  if (cancel_requested_.load()) {
    Terminate(SendState::kCancelled, absl::CancelledError("prefill cancelled"));
    return;
  }
  absl::Status failed;
  {
    absl::MutexLock l(&failures_->mu);
    failed = failures_->first;
  }
  if (!failed.ok()) Fail(TransferError(failed));
}

void SendSession::ObserveDeadline() {
  if (!Live() || context_->clock->Now() < spec_.deadline) return;
  idle_deadline_ = pending_.empty();
  Fail(TransferError(absl::DeadlineExceededError(
      absl::StrCat("deadline passed in ", SendStateName(state_), " with ",
                   pending_.size(), " batches in flight"))));
}

void SendSession::Fail(absl::Status status) {
  Terminate(SendState::kFailed, std::move(status));
}

void SendSession::Terminate(SendState end, absl::Status status) {
  if (!Live()) return;
  state_ = end;
  status_ = std::move(status);
  CancelInFlight();
  Record();
}

void SendSession::CancelInFlight() {
  for (kvtransfer::BatchId b : pending_) context_->agent->Cancel(b).IgnoreError();
}

absl::Status SendSession::TransferError(const absl::Status& s) const {
  return absl::Status(s.code(),
                      absl::StrCat("transfer of request ", spec_.request_id, " to ",
                                   spec_.targets[0].address, " failed: ", s.message()));
}

absl::Time SendSession::AgentDeadline(absl::Duration cap) const {
  absl::Duration left = cap;
  if (spec_.deadline != absl::InfiniteFuture()) {
    left = std::min(left, spec_.deadline - context_->clock->Now());
  }
  if (left == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return absl::Now() + std::max(left, absl::ZeroDuration());
}

absl::Status SendSession::Post(int rank,
                               absl::Span<const kvtransfer::Segment> segments) {
  if (first_post_ == absl::InfiniteFuture()) first_post_ = context_->clock->Now();
  std::shared_ptr<BatchFailures> failures = failures_;
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::BatchId batch,
                          context_->agent->PostWrite(
                              peers_[rank], segments,
                              [failures](kvtransfer::BatchId, const absl::Status& s) {
                                if (s.ok()) return;
                                absl::MutexLock l(&failures->mu);
                                if (failures->first.ok()) failures->first = s;
                              }));
  pending_.push_back(batch);
  ++stats_.batches;
  stats_.segments += static_cast<int64_t>(segments.size());
  for (const kvtransfer::Segment& g : segments) stats_.bytes += g.length;
  if (context_->metrics != nullptr) context_->metrics->transfer_batches->Increment();
  return absl::OkStatus();
}

void SendSession::OnLayer(int layer, const LayerRows& en) {
  ObserveCancelAndFailures();
  ObserveDeadline();
  if (!spec_.stream_layers) return;
  if (state_ != SendState::kComputing && state_ != SendState::kStreaming) return;
  if (layer < 0 || layer >= static_cast<int>(rows_.size())) {
    Fail(TransferError(
        Internal("layer progress for layer ", layer, " of ", rows_.size())));
    return;
  }
  if (chunk_end_[layer] >= 0 && en.start != chunk_end_[layer]) {
    // Recomputed from another position (preempted): the rows posted so far
    // may have been read from blocks freed since. Stop streaming; the whole
    // state goes after the prefill, once every earlier batch has ended.
    state_ = SendState::kRestarted;
    if (context_->metrics != nullptr) context_->metrics->transfer_restarts->Increment();
    TLOG(INFO, "prefill recomputed; the transfer restarts after the prefill")
        .Kv("request_id", spec_.request_id)
        .Kv("layer", layer)
        .Kv("start_pos", en.start)
        .Kv("rows_posted", rows_[layer]);
    return;
  }
  // The layer's first chunk may start past row 0: the prefill's own prefix
  // hit, whose rows before it are final in the shared cached blocks of the
  // block table; they go with this chunk's (from the receiver's held rows on).
  chunk_end_[layer] = en.end;
  const int64_t begin = rows_[layer];
  const int64_t end = std::max(begin, en.end);
  rows_[layer] = end;
  const kvtransfer::LayerRef ref = context_->layers[layer];
  // A KDA slot is final only after the prompt's last chunk.
  if (ref.kind == kvtransfer::LayerKind::kKda && !en.completes_prefill) return;
  if (ref.kind == kvtransfer::LayerKind::kMla && end == begin) return;  // all held
  // Every rank's rows of the layer to the same rank of the target (the engine
  // reports a layer after its all-reduce: final on every rank).
  for (size_t r = 0; r < sources_.size(); ++r) {
    kvtransfer::RankLayout& src = sources_[r];
    src.block_ids.assign(en.block_table.begin(), en.block_table.end());
    src.state_slot = en.slot;
    absl::StatusOr<kvtransfer::TransferPlan> plan =
        kvtransfer::PlanLayerRows(src, spec_.targets[r].layout, ref, begin, end);
    if (!plan.ok()) {
      Fail(TransferError(plan.status()));
      return;
    }
    if (plan->segments.empty()) continue;
    if (absl::Status p = Post(static_cast<int>(r), plan->segments); !p.ok()) {
      Fail(TransferError(p));
      return;
    }
    state_ = SendState::kStreaming;
  }
}

void SendSession::Computed(const ComputedState& at) {
  if (computed_) return;
  computed_ = true;
  computed_at_ = context_->clock->Now();
  stats_.prefill = computed_at_ - started_;
  if (context_->metrics != nullptr) {
    context_->metrics->prefill_seconds->Observe(absl::ToDoubleSeconds(stats_.prefill));
  }
  ObserveCancelAndFailures();
  if (!Live()) {
    Record();
    return;
  }
  const int64_t n = spec_.num_tokens;
  if (at.num_cached_tokens != n) {
    Fail(Internal("request ", spec_.request_id, ": ", at.num_cached_tokens,
                  " cached tokens after prefill, expected ", n));
    return;
  }
  // Per rank: the sequence in the rank's cache, its whole-state plan to the
  // target's same rank, its checksums (with streaming, while the last batches
  // are in flight).
  std::vector<tandem::v1::StateChecksums> sums;
  for (size_t r = 0; r < sources_.size(); ++r) {
    kvtransfer::RankLayout& src = sources_[r];
    src.block_ids.assign(at.block_ids.begin(), at.block_ids.end());
    src.state_slot = at.slot;
    absl::StatusOr<kvtransfer::TransferPlan> plan =
        kvtransfer::PlanAll(src, spec_.targets[r].layout, n, spec_.held_tokens);
    if (!plan.ok()) {
      Fail(plan.status());
      return;
    }
    plans_.push_back(std::move(*plan));
    if (spec_.checksums) {
      const SendSource& source = context_->sources[r];
      absl::StatusOr<tandem::v1::StateChecksums> c = kvtransfer::ComputeChecksums(
          src, n,
          kvtransfer::ChecksumMemory{source.bytes, source.host_addressable,
                                     source.hasher});
      if (!c.ok()) {
        Fail(c.status());
        return;
      }
      sums.push_back(std::move(*c));
    }
  }
  if (spec_.checksums) checksums_ = worker::MergeRankChecksums(sums);
  // Streamed: every layer must have had all its rows posted; otherwise (or when
  // recomputed) the whole state goes after the streamed batches.
  stats_.whole = !spec_.stream_layers || state_ == SendState::kRestarted;
  if (!stats_.whole) {
    for (int64_t rows : rows_) {
      if (rows != n) {
        TLOG(WARNING, "a layer was not fully streamed; sending the whole state")
            .Kv("request_id", spec_.request_id)
            .Kv("rows", rows)
            .Kv("prompt_tokens", n);
        stats_.whole = true;
        break;
      }
    }
  }
  if (peers_.empty()) {
    if (absl::Status c = ConnectAll(); !c.ok()) {
      Fail(c);
      return;
    }
  }
  state_ = SendState::kDraining;
}

void SendSession::Ended(kvtransfer::BatchId batch, const absl::Status& s) {
  auto it = std::find(pending_.begin(), pending_.end(), batch);
  if (it != pending_.end()) pending_.erase(it);
  if (!s.ok()) Fail(TransferError(s));  // no-op once terminal
}

void SendSession::PollInFlight() {
  // A copy: Ended() edits pending_.
  const std::vector<kvtransfer::BatchId> batches = pending_;
  for (kvtransfer::BatchId b : batches) {
    absl::StatusOr<bool> done = context_->agent->Poll(b);
    if (done.ok() && !*done) continue;
    Ended(b, done.status());
  }
}

bool SendSession::Step() {
  ObserveCancelAndFailures();
  PollInFlight();
  ObserveDeadline();
  if (Live() && pending_.empty() &&
      (state_ == SendState::kDraining || state_ == SendState::kFinishing)) {
    Advance();
  }
  return !Live();
}

void SendSession::Advance() {
  if (state_ == SendState::kDraining) {
    // Every streamed batch ended OK (also when restarting: the earlier batches
    // end before anything is rewritten).
    if (context_->test_corrupt_transfer && !plans_.empty() &&
        !plans_[0].segments.empty() && context_->sources[0].host_addressable) {
      // TEST ONLY: damage the first byte rank 0's plan sends (after the
      // checksums); a streamed state has that piece sent again.
      const kvtransfer::Segment& s0 = plans_[0].segments.front();
      absl::Span<const uint8_t> region = context_->sources[0].bytes(s0.local_region);
      const_cast<uint8_t*>(region.data())[s0.local_offset] ^= 0x5A;
      TLOG(WARNING, "TEST ONLY: corrupted one byte of the transfer")
          .Kv("request_id", spec_.request_id);
      if (!stats_.whole) {
        if (absl::Status p = Post(0, absl::MakeConstSpan(&s0, 1)); !p.ok()) {
          Fail(TransferError(p));
          return;
        }
      }
    }
    if (stats_.whole) {
      for (size_t r = 0; r < plans_.size(); ++r) {
        if (plans_[r].segments.empty()) continue;
        if (absl::Status p = Post(static_cast<int>(r), plans_[r].segments); !p.ok()) {
          Fail(TransferError(p));
          return;
        }
      }
    }
    if (!pending_.empty()) {
      state_ = SendState::kFinishing;
      return;
    }
  }
  Notify();
}

void SendSession::Notify() {
  const absl::Time landed = context_->clock->Now();
  const std::string token = spec_.reservation_token == 0
                                ? std::string()
                                : absl::StrCat(spec_.reservation_token);
  absl::Status s = context_->agent->Notify(peers_[0], spec_.request_id, token,
                                           AgentDeadline(absl::InfiniteDuration()));
  if (!s.ok()) {
    Fail(TransferError(s));
    return;
  }
  const absl::Time first = first_post_ == absl::InfiniteFuture() ? landed : first_post_;
  stats_.transfer = landed - first;
  stats_.exposed = landed - computed_at_;
  stats_.transport = context_->agent->Transport(peers_[0]);
  state_ = SendState::kDone;
  Record();
  TLOG(DEBUG, "prefill done")
      .Kv("request_id", spec_.request_id)
      .Kv("prompt_tokens", spec_.num_tokens)
      .Kv("streamed", !stats_.whole)
      .Kv("batches", stats_.batches)
      .Kv("bytes", stats_.bytes)
      .Kv("segments", stats_.segments)
      .Kv("transfer_s", absl::ToDoubleSeconds(stats_.transfer))
      .Kv("exposed_s", absl::ToDoubleSeconds(stats_.exposed));
}

absl::Status SendSession::Run() {
  if (Live() && !computed_) {
    return FailedPrecondition("request ", spec_.request_id,
                              ": Run before the state was computed");
  }
  while (!Step()) {
    if (pending_.empty()) continue;  // Step advances; not reached in practice
    const kvtransfer::BatchId b = pending_.front();
    const absl::Status s = context_->agent->Wait(b, AgentDeadline(kWaitSlice));
    if (!absl::IsDeadlineExceeded(s)) Ended(b, s);
  }
  End();
  return status_;
}

void SendSession::End() {
  Terminate(SendState::kCancelled, absl::CancelledError(absl::StrCat(
                                       "the transfer of request ", spec_.request_id,
                                       " ended before it finished")));
  if (!pending_.empty()) {
    CancelInFlight();
    bool stuck = false;
    for (kvtransfer::BatchId b : pending_) {
      const absl::Status d = context_->agent->Wait(b, absl::Now() + kDrainGrace);
      if (absl::IsDeadlineExceeded(d) && !stuck) {
        stuck = true;
        TLOG(WARNING, "a cancelled batch did not drain; dropping the peer")
            .Kv("request_id", spec_.request_id);
        DropPeers();  // ends their in-flight batches
      }
    }
    pending_.clear();
  }
  // The peer is dropped when the transport failed or a deadline passed with
  // bytes in flight to it (the connection may be wedged); a deadline that found
  // nothing in flight keeps the connection every other request to it shares.
  if (state_ == SendState::kFailed && !idle_deadline_ &&
      (absl::IsUnavailable(status_) || absl::IsDeadlineExceeded(status_))) {
    DropPeers();
  }
}

void SendSession::DropPeers() {
  if (peers_dropped_) return;
  peers_dropped_ = true;
  for (size_t r = 0; r < peers_.size(); ++r) {
    if (std::find(peers_.begin(), peers_.begin() + r, peers_[r]) ==
        peers_.begin() + r) {
      context_->peers->Drop(peers_[r]);
    }
  }
}

void SendSession::Record() {
  if (!computed_ || recorded_ || Live()) return;
  recorded_ = true;
  worker::WorkerMetrics* m = context_->metrics;
  if (m == nullptr) return;
  const bool ok = state_ == SendState::kDone;
  m->transfers->Add({{"outcome", ok ? "ok" : "error"}}).Increment();
  if (ok) {
    m->transfer_bytes->Increment(static_cast<double>(stats_.bytes));
    m->transfer_seconds->Increment(absl::ToDoubleSeconds(stats_.transfer));
    m->exposed_transfer_seconds->Observe(absl::ToDoubleSeconds(stats_.exposed));
  }
}

}  // namespace tandem::prefill
