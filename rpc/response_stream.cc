#include "rpc/response_stream.h"

namespace tandem::rpc {
namespace {

bool LogprobsAligned(const tandem::v1::GenerateResponse& m) {
  return m.logprobs_size() == 0 || m.logprobs_size() == m.token_ids_size();
}

}  // namespace

bool CoalesceResponse(tandem::v1::GenerateResponse* pending,
                      tandem::v1::GenerateResponse* next) {
  if (pending->finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED ||
      pending->has_usage() || !pending->matched_stop().empty()) {
    return false;  // a last message stays last
  }
  if (pending->request_id() != next->request_id()) return false;
  if (!LogprobsAligned(*pending) || !LogprobsAligned(*next)) return false;
  // One with logprobs and one without (with tokens) would misalign them.
  const bool pending_lp = pending->logprobs_size() > 0;
  const bool next_lp = next->logprobs_size() > 0;
  if (pending_lp != next_lp && pending->token_ids_size() > 0 &&
      next->token_ids_size() > 0) {
    return false;
  }
  if (pending->has_seed() && next->has_seed() && pending->seed() != next->seed()) {
    return false;
  }
  // Prompt logprobs come once, on the first message.
  if (pending->prompt_logprobs_size() > 0 && next->prompt_logprobs_size() > 0) {
    return false;
  }
  for (auto& lp : *next->mutable_prompt_logprobs()) {
    *pending->add_prompt_logprobs() = std::move(lp);
  }
  pending->mutable_token_ids()->Add(next->token_ids().begin(), next->token_ids().end());
  for (auto& lp : *next->mutable_logprobs()) {
    *pending->add_logprobs() = std::move(lp);
  }
  pending->mutable_text()->append(next->text());
  if (!pending->has_seed() && next->has_seed()) pending->set_seed(next->seed());
  pending->set_finish_reason(next->finish_reason());
  pending->set_matched_stop(next->matched_stop());
  if (next->has_usage()) *pending->mutable_usage() = std::move(*next->mutable_usage());
  return true;
}

void ResponseStream::SetOnCancel(std::function<void()> on_cancel) {
  bool run_now = false;
  {
    absl::MutexLock l(&mu_);
    if (cancelled_) {
      run_now = true;
    } else {
      on_cancel_ = on_cancel;
    }
  }
  if (run_now && on_cancel) on_cancel();
}

void ResponseStream::Push(tandem::v1::GenerateResponse message) {
  absl::MutexLock l(&mu_);
  if (cancelled_ || closing_ || write_failed_) return;
  // queue_.front() is the message being written while writing_; anything
  // behind it waits, and the newest waiting message absorbs this one.
  if (writing_ && queue_.size() >= 2 && CoalesceResponse(&queue_.back(), &message)) {
    ++coalesced_;
    return;
  }
  queue_.push_back(std::move(message));
  PumpLocked();
}

int64_t ResponseStream::coalesced() const {
  absl::MutexLock l(&mu_);
  return coalesced_;
}

void ResponseStream::Close(const grpc::Status& status) {
  {
    absl::MutexLock l(&mu_);
    if (!closing_) {
      closing_ = true;
      status_ = status;
      PumpLocked();
    }
  }
  Unref();
}

bool ResponseStream::cancelled() const {
  absl::MutexLock l(&mu_);
  return cancelled_;
}

void ResponseStream::PumpLocked() {
  if (finished_ || writing_) return;
  if (cancelled_ || write_failed_) {
    queue_.clear();
    finished_ = true;
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the call"));
    return;
  }
  if (!queue_.empty()) {
    writing_ = true;
    StartWrite(&queue_.front());
    return;
  }
  if (closing_) {
    finished_ = true;
    Finish(status_);
  }
}

void ResponseStream::OnWriteDone(bool ok) {
  absl::MutexLock l(&mu_);
  writing_ = false;
  queue_.pop_front();
  if (!ok) write_failed_ = true;
  PumpLocked();
}

void ResponseStream::OnCancel() {
  std::function<void()> hook;
  {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    hook = std::move(on_cancel_);
    on_cancel_ = nullptr;
    PumpLocked();
  }
  if (hook) hook();
}

void ResponseStream::OnDone() { Unref(); }

void ResponseStream::Unref() {
  bool last = false;
  {
    absl::MutexLock l(&mu_);
    last = --refs_ == 0;
  }
  if (last) delete this;
}

}  // namespace tandem::rpc
