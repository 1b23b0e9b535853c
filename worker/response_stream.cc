#include "worker/response_stream.h"

namespace tandem::worker {

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
  queue_.push_back(std::move(message));
  PumpLocked();
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

}  // namespace tandem::worker
