#include "router/placement.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "router/pair_selection.h"

namespace tandem::router {

using Kind = Placement::Action::Kind;

const char* PlacementStateName(Placement::State state) {
  switch (state) {
    case Placement::State::kStart:
      return "START";
    case Placement::State::kReserving:
      return "RESERVING";
    case Placement::State::kPrefilling:
      return "PREFILLING";
    case Placement::State::kReleasing:
      return "RELEASING";
    case Placement::State::kDecoding:
      return "DECODING";
    case Placement::State::kColocated:
      return "COLOCATED";
    case Placement::State::kQueued:
      return "QUEUED";
    case Placement::State::kFinished:
      return "FINISHED";
  }
  return "?";
}

Placement::Placement(PlacementDeps deps, const HandoffOptions& options,
                     PlacementRequest request)
    : deps_(deps), options_(options), request_(std::move(request)) {}

namespace {

absl::Status ClientCancelled() {
  return absl::CancelledError("cancelled by the client");
}

}  // namespace

bool Placement::Expired() const { return deps_.clock->Now() >= request_.deadline; }

Placement::Action Placement::Call(Kind kind, const WorkerRecord& worker,
                                  absl::Time deadline) {
  Action a{.kind = kind};
  a.worker = worker;
  a.deadline = deadline;
  return a;
}

int32_t ReservationLeaseMs(absl::Time request_deadline, absl::Time now,
                           int32_t min_lease_ms) {
  const absl::Duration left = request_deadline - now;
  const int64_t ms = left == absl::InfiniteDuration()
                         ? std::numeric_limits<int32_t>::max()
                         : absl::ToInt64Milliseconds(left);
  return static_cast<int32_t>(std::clamp<int64_t>(
      ms, std::max<int32_t>(min_lease_ms, 0), std::numeric_limits<int32_t>::max()));
}

Placement::Actions Placement::Start() {
  if (state_ != State::kStart) return {};
  if (cancelled_) return Finish(ClientCancelled());
  if (Expired()) return Expire(/*holds_reservation=*/false);
  const int32_t prompt = request_.prompt_tokens;
  if (request_.has_images) {
    // Colocate() refuses them: without a prefill worker nothing is reserved.
    return deps_.registry->Available(tandem::v1::WORKER_ROLE_PREFILL).empty()
               ? Colocate()
               : Reserve();
  }
  bool colocate =
      request_.min_tokens > 0 ||
      (options_.max_context_tokens > 0 && prompt + 1 >= options_.max_context_tokens) ||
      deps_.registry->Available(tandem::v1::WORKER_ROLE_PREFILL).empty();
  // Conditional disaggregation by the uncached length: the prompt less what
  // the decode worker holding most of it reported (prefix_routing.h), so a
  // long prompt with a short new suffix is prefilled where its prefix is.
  if (!colocate && prompt < options_.colocate_below_tokens) {
    colocate = true;
  } else if (!colocate && options_.colocate_below_tokens > 0 &&
             deps_.prefill_router != nullptr) {
    std::optional<DecodeMatch> m = deps_.prefill_router->BestMatch(
        deps_.registry->Available(tandem::v1::WORKER_ROLE_DECODE), {}, prompt,
        request_.prefix_hashes);
    if (m.has_value() && prompt - m->matched_tokens < options_.colocate_below_tokens) {
      colocate = true;
      preferred_decode_ = m->worker_id;
      deps_.metrics->estimated_hit_tokens->Increment(
          static_cast<double>(m->matched_tokens));
    }
  }
  return colocate ? Colocate() : Reserve();
}

Placement::Actions Placement::Cancel() {
  if (state_ == State::kFinished || cancelled_) return {};
  cancelled_ = true;
  switch (state_) {
    case State::kStart:
      return {};  // Start finishes it
    case State::kReleasing:
      // The Release goes on by itself; nothing else is in flight.
      return Finish(ClientCancelled());
    case State::kQueued: {
      Actions out = {Action{.kind = Kind::kDequeue}};
      for (Action& a : Finish(ClientCancelled())) out.push_back(std::move(a));
      return out;
    }
    default:
      // The call's end (CANCELLED, or OK if it won the race) finishes it.
      return {Action{.kind = Kind::kCancelCall}};
  }
}

bool Placement::MayShareWith(const WorkerRecord& decode) const {
  return !request_.has_images || decode.registration.reserves_with_images();
}

// RESERVING
Placement::Actions Placement::Reserve() {
  state_ = State::kReserving;
  if (cancelled_) return Finish(ClientCancelled());
  if (Expired()) return Expire(/*holds_reservation=*/false);
  // Draining workers (shutting down) take no new request.
  std::vector<WorkerRecord> live =
      deps_.registry->Available(tandem::v1::WORKER_ROLE_DECODE);
  // The decode worker may share cached blocks only for a prefill worker that
  // writes after them: an older one writes every row from 0, into blocks
  // other sequences share. A prompt with images only with a decode worker
  // that mixes the images' hashes into its keys (reserves_with_images).
  bool share = !no_sharing_;
  if (share) {
    share = false;
    for (const WorkerRecord& p :
         deps_.registry->Available(tandem::v1::WORKER_ROLE_PREFILL)) {
      share |= p.registration.writes_after_held_prefix() &&
               !tried_prefill_.contains(p.registration.worker_id());
    }
  }
  // What each decode worker reported holding of the prompt's MLA rows (a
  // decode-side prefix hit there keeps them off the wire).
  absl::flat_hash_map<std::string, int64_t> held;
  if (deps_.prefill_router != nullptr && share) {
    std::vector<WorkerRecord> sharing;
    for (const WorkerRecord& w : live) {
      if (MayShareWith(w)) sharing.push_back(w);
    }
    held = deps_.prefill_router->HeldBlocks(sharing, request_.prompt_tokens,
                                            request_.prefix_hashes);
  }
  std::optional<size_t> i = SelectDecode(
      live, tried_decode_, deps_.ledger->Snapshot(live), request_.prompt_tokens, &held);
  if (!i.has_value()) return NoDecodeWorker(AfterRelease::kReserve);
  decode_ = live[*i];
  if (auto h = held.find(decode_.registration.worker_id()); h != held.end()) {
    deps_.metrics->estimated_decode_held_tokens->Increment(
        static_cast<double>(h->second));
  }
  Action a =
      Call(Kind::kReserve, decode_,
           std::min(request_.deadline, deps_.clock->Now() + options_.rpc_timeout));
  a.share_held_prefix = share && MayShareWith(decode_);
  // The spans of the images (no bytes) for a worker that reads them: its keys
  // mix them in, and it never recomputes their rows.
  a.send_images = request_.has_images && decode_.registration.reserves_with_images();
  return {std::move(a)};
}

Placement::Actions Placement::OnReserved(const absl::Status& status,
                                         int64_t held_tokens) {
  if (state_ != State::kReserving) return {};
  const std::string id = decode_.registration.worker_id();
  if (status.ok()) {
    held_tokens_ = held_tokens;
    if (cancelled_) return ReleaseAndFinish(ClientCancelled());
    deps_.ledger->Place(decode_, request_.request_id, request_.prompt_tokens);
    return Prefill();
  }
  // A Reserve that ended without its answer (cancelled, or its deadline) may
  // still have reserved on the decode worker: release it (a Release of nothing
  // is harmless) rather than leave it to the lease.
  const bool maybe_reserved =
      absl::IsCancelled(status) || absl::IsDeadlineExceeded(status);
  if (cancelled_) {
    return maybe_reserved ? ReleaseAndFinish(ClientCancelled())
                          : Finish(ClientCancelled());
  }
  if (maybe_reserved) return ReleaseAndFinish(status);
  tried_decode_.insert(id);
  switch (status.code()) {
    case absl::StatusCode::kResourceExhausted:
      decode_full_ = true;
      deps_.metrics->retries->Add({{"reason", "decode_full"}}).Increment();
      return Reserve();
    case absl::StatusCode::kUnavailable:
      deps_.registry->Remove(id);
      deps_.metrics->retries->Add({{"reason", "decode_unavailable"}}).Increment();
      return Reserve();
    default:
      return Finish(status);
  }
}

Placement::Actions Placement::NoDecodeWorker(AfterRelease then) {
  // A live decode worker that was not tried was skipped for lack of room: the
  // cluster is full, not down.
  bool skipped_full = false;
  for (const WorkerRecord& w : deps_.registry->Live(tandem::v1::WORKER_ROLE_DECODE)) {
    if (!tried_decode_.contains(w.registration.worker_id())) skipped_full = true;
  }
  if (decode_full_ || skipped_full) {
    state_ = State::kQueued;
    after_queue_ = then;
    Action a{.kind = Kind::kQueue};
    a.deadline = request_.deadline;
    return {std::move(a)};
  }
  return Finish(absl::UnavailableError(
      absl::StrCat("no decode worker can take this request (prompt of ",
                   request_.prompt_tokens, " tokens); the request was not started")));
}

// QUEUED
Placement::Actions Placement::OnQueueEnd(const absl::Status& status) {
  if (state_ != State::kQueued) return {};
  if (cancelled_) return Finish(ClientCancelled());
  if (absl::IsResourceExhausted(status)) {
    return Finish(ResourceExhausted("every decode worker is full and ",
                                    status.message(), " (prompt of ",
                                    request_.prompt_tokens, " tokens)"));
  }
  if (!status.ok()) return Finish(status);
  // Capacity may have freed anywhere: every worker is a candidate again.
  tried_decode_.clear();
  decode_full_ = false;
  return after_queue_ == AfterRelease::kReserve ? Reserve() : Colocate();
}

// PREFILLING
Placement::Actions Placement::Prefill() {
  if (Expired()) return Expire(/*holds_reservation=*/true);
  std::vector<WorkerRecord> live =
      deps_.registry->Available(tandem::v1::WORKER_ROLE_PREFILL);
  // The reservation shares rows: a worker that would write them (it did not
  // register writes_after_held_prefix) is not a candidate.
  absl::flat_hash_set<std::string> exclude = tried_prefill_;
  bool writer_skipped = false;
  if (held_tokens_ > 0) {
    for (const WorkerRecord& w : live) {
      if (!w.registration.writes_after_held_prefix() &&
          exclude.insert(w.registration.worker_id()).second) {
        writer_skipped = true;
      }
    }
  }
  std::optional<size_t> i;
  if (deps_.prefill_router != nullptr) {
    std::optional<PrefillChoice> c =
        deps_.prefill_router->Select(live, exclude, deps_.ledger->Snapshot(live),
                                     request_.prompt_tokens, request_.prefix_hashes);
    if (c.has_value()) {
      i = c->index;
      const char* reason =
          c->balanced ? "balance" : (c->matched_tokens > 0 ? "cache" : "load");
      deps_.metrics->prefill_choices
          ->Add({{"policy", RoutingPolicyName(deps_.prefill_router->policy())},
                 {"reason", reason}})
          .Increment();
      if (c->matched_tokens > 0) {
        deps_.metrics->estimated_hit_tokens->Increment(
            static_cast<double>(c->matched_tokens));
      }
    }
  } else {
    i = SelectPrefill(live, exclude, deps_.ledger->Snapshot(live));
    if (i.has_value()) {
      deps_.metrics->prefill_choices
          ->Add({{"policy", "least_load"}, {"reason", "load"}})
          .Increment();
    }
  }
  if (!i.has_value() && writer_skipped) {
    // Only workers that would overwrite the shared rows are left: reserve
    // again sharing nothing (that reservation takes any of them).
    TLOG(INFO, "no prefill worker writes after held rows; reserving again unshared")
        .Kv("request_id", request_.request_id)
        .Kv("held_tokens", held_tokens_);
    deps_.metrics->retries->Add({{"reason", "held_prefix_writer"}}).Increment();
    no_sharing_ = true;
    tried_decode_.clear();
    return ReleaseThen(AfterRelease::kReserve);
  }
  if (!i.has_value()) {
    // No prefill worker left: prefill on a decode worker instead, once the
    // reservation made for this request id is gone.
    deps_.metrics->retries->Add({{"reason", "colocated_fallback"}}).Increment();
    TLOG(INFO, "no prefill worker available; prefilling on a decode worker")
        .Kv("request_id", request_.request_id);
    tried_decode_.clear();
    return ReleaseThen(AfterRelease::kColocate);
  }
  prefill_ = live[*i];
  ++prefill_attempts_;
  deps_.ledger->Place(prefill_, request_.request_id, request_.prompt_tokens);
  state_ = State::kPrefilling;
  return {Call(Kind::kPrefill, prefill_, request_.deadline)};
}

Placement::Actions Placement::OnPrefilled(const absl::Status& status) {
  if (state_ != State::kPrefilling) return {};
  const std::string pid = prefill_.registration.worker_id();
  deps_.ledger->Unplace(pid, request_.request_id);
  if (cancelled_) return ReleaseAndFinish(ClientCancelled());
  if (status.ok()) return Decode();
  if (absl::IsUnavailable(status)) {
    // The prefill worker (or its transfer) is gone: try another one.
    TLOG(WARNING, "prefill worker lost before the hand-off; retrying")
        .Kv("request_id", request_.request_id)
        .Kv("worker_id", pid)
        .Kv("status", status.message());
    deps_.registry->Remove(pid);
    tried_prefill_.insert(pid);
    deps_.metrics->retries->Add({{"reason", "prefill_unavailable"}}).Increment();
    if (prefill_attempts_ < options_.max_prefill_attempts) {
      tried_decode_.clear();
      return ReleaseThen(AfterRelease::kReserve);
    }
    return ReleaseAndFinish(absl::UnavailableError(
        absl::StrCat("prefill failed on ", prefill_attempts_, " workers; last (", pid,
                     "): ", status.message())));
  }
  return ReleaseAndFinish(status);
}

// RELEASING
Placement::Action Placement::ReleaseAction(bool await) {
  deps_.ledger->Unplace(decode_.registration.worker_id(), request_.request_id);
  Action a = Call(Kind::kRelease, decode_, deps_.clock->Now() + options_.rpc_timeout);
  a.await = await;
  return a;
}

Placement::Actions Placement::ReleaseThen(AfterRelease next) {
  state_ = State::kReleasing;
  after_release_ = next;
  return {ReleaseAction(/*await=*/true)};
}

Placement::Actions Placement::ReleaseAndFinish(absl::Status status) {
  Actions out = {ReleaseAction(/*await=*/false)};
  for (Action& a : Finish(std::move(status))) out.push_back(std::move(a));
  return out;
}

Placement::Actions Placement::OnReleased(const absl::Status&) {
  // A failed Release is left to the lease; the next step is the same.
  if (state_ != State::kReleasing) return {};
  if (cancelled_) return Finish(ClientCancelled());
  return after_release_ == AfterRelease::kReserve ? Reserve() : Colocate();
}

// COLOCATED
Placement::Actions Placement::Colocate() {
  if (cancelled_) return Finish(ClientCancelled());
  if (Expired()) return Expire(/*holds_reservation=*/false);
  if (request_.has_images) {
    // Only a prefill worker runs the vision tower.
    return Finish(absl::UnavailableError(
        "no prefill worker is available, and a prompt with images is prefilled "
        "only on one (the vision tower runs there); the request was not started"));
  }
  // Draining workers (shutting down) take no new request.
  std::vector<WorkerRecord> live =
      deps_.registry->Available(tandem::v1::WORKER_ROLE_DECODE);
  std::optional<size_t> i;
  // The decode worker whose cache made this request colocated, when it has
  // room; else the usual choice.
  if (!preferred_decode_.empty() && !tried_decode_.contains(preferred_decode_)) {
    for (size_t k = 0; k < live.size(); ++k) {
      if (live[k].registration.worker_id() != preferred_decode_) continue;
      std::vector<WorkerRecord> one = {live[k]};
      if (SelectDecode(one, {}, deps_.ledger->Snapshot(one), request_.prompt_tokens)
              .has_value()) {
        i = k;
      }
    }
  }
  if (!i.has_value()) {
    i = SelectDecode(live, tried_decode_, deps_.ledger->Snapshot(live),
                     request_.prompt_tokens);
  }
  if (!i.has_value()) return NoDecodeWorker(AfterRelease::kColocate);
  deps_.metrics->paths->Add({{"path", "colocated"}}).Increment();
  decode_ = live[*i];
  // The decode worker prefills this prompt itself: until it reports it, the
  // router counts it as cached there.
  if (deps_.prefill_router != nullptr) {
    deps_.prefill_router->RecordSent(decode_.registration.worker_id(),
                                     request_.prefix_hashes, request_.prompt_tokens);
  }
  state_ = State::kColocated;
  return {Call(Kind::kColocate, decode_, request_.deadline)};
}

// DECODING
Placement::Actions Placement::Decode() {
  if (Expired()) return Expire(/*holds_reservation=*/true);
  deps_.metrics->paths->Add({{"path", "disaggregated"}}).Increment();
  state_ = State::kDecoding;
  return {Call(Kind::kDecode, decode_, request_.deadline)};
}

Placement::Actions Placement::OnStreamDone(const absl::Status& status) {
  if (state_ != State::kDecoding && state_ != State::kColocated) return {};
  const WorkerRecord& w = decode_;
  if (status.ok()) {
    // Its slot and blocks are free on the worker now: credited at once, so a
    // request queued for that room is placed without waiting for the worker's
    // next load report (the worker's record as of now: its report count).
    bool credited = false;
    for (const WorkerRecord& now :
         deps_.registry->Live(tandem::v1::WORKER_ROLE_DECODE)) {
      if (now.registration.worker_id() != w.registration.worker_id()) continue;
      deps_.ledger->Finished(now, request_.request_id, request_.prompt_tokens,
                             /*reports_at_start=*/w.reports);
      credited = true;
    }
    if (!credited)
      deps_.ledger->Unplace(w.registration.worker_id(), request_.request_id);
    return Finish(absl::OkStatus());
  }
  deps_.ledger->Unplace(w.registration.worker_id(), request_.request_id);
  if (cancelled_) return Finish(ClientCancelled());
  if (absl::IsUnavailable(status)) {
    deps_.registry->Remove(w.registration.worker_id());
    return Finish(absl::UnavailableError(absl::StrCat(
        "decode worker ", w.registration.worker_id(), " (",
        w.registration.grpc_address(),
        ") failed or became unreachable during the request: ", status.message())));
  }
  return Finish(status);
}

Placement::Actions Placement::Expire(bool holds_reservation) {
  absl::Status s = absl::DeadlineExceededError(
      absl::StrCat("the request's deadline passed in ", PlacementStateName(state_),
                   " (request ", request_.request_id, ")"));
  if (holds_reservation) return ReleaseAndFinish(std::move(s));
  return Finish(std::move(s));
}

// FINISHED
Placement::Actions Placement::Finish(absl::Status status) {
  if (state_ == State::kFinished) return {};
  state_ = State::kFinished;
  deps_.metrics->latency->Observe(
      absl::ToDoubleSeconds(deps_.clock->Now() - request_.started));
  Action a{.kind = Kind::kFinish};
  a.status = std::move(status);
  return {std::move(a)};
}

}  // namespace tandem::router
