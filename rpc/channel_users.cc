#include "rpc/channel_users.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "common/logging.h"

namespace tandem::rpc {

struct ChannelUsers::State {
  absl::Mutex mu;
  int64_t users ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  absl::flat_hash_map<uint64_t, grpc::ClientContext*> tracked ABSL_GUARDED_BY(mu);
};

ChannelUsers::Use& ChannelUsers::Use::operator=(Use&& other) noexcept {
  if (this != &other) {
    Leave();
    state_ = std::move(other.state_);
    id_ = other.id_;
  }
  return *this;
}

ChannelUsers::Use::~Use() { Leave(); }

void ChannelUsers::Use::Track(grpc::ClientContext* context) {
  if (state_ == nullptr) return;
  absl::MutexLock l(&state_->mu);
  state_->tracked[id_] = context;
}

void ChannelUsers::Use::Untrack() {
  if (state_ == nullptr) return;
  absl::MutexLock l(&state_->mu);
  state_->tracked.erase(id_);
}

void ChannelUsers::Use::Leave() {
  if (state_ == nullptr) return;
  const std::shared_ptr<State> state = std::move(state_);
  absl::MutexLock l(&state->mu);
  state->tracked.erase(id_);
  --state->users;
}

ChannelUsers::ChannelUsers() : state_(std::make_shared<State>()) {}

ChannelUsers::Use ChannelUsers::Enter() const {
  absl::MutexLock l(&state_->mu);
  ++state_->users;
  return Use(state_, state_->next_id++);
}

void ChannelUsers::CancelAll() const {
  // Under the lock: a tracked context is alive until its Untrack, which waits.
  absl::MutexLock l(&state_->mu);
  for (auto& [id, context] : state_->tracked) context->TryCancel();
}

int64_t ChannelUsers::count() const {
  absl::MutexLock l(&state_->mu);
  return state_->users;
}

bool ChannelUsers::WaitIdle(absl::Duration timeout) const {
  State& s = *state_;
  absl::MutexLock l(&s.mu);
  auto idle = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.users == 0; };
  return s.mu.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void ChannelUsers::ReleaseChannel(std::shared_ptr<grpc::Channel> channel,
                                  absl::Duration timeout,
                                  const std::string& owner) const {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  if (channel != nullptr) channels.push_back(std::move(channel));
  ReleaseChannels(std::move(channels), timeout, owner);
}

void ChannelUsers::ReleaseChannels(std::vector<std::shared_ptr<grpc::Channel>> channels,
                                   absl::Duration timeout,
                                   const std::string& owner) const {
  if (WaitIdle(timeout)) return;  // `channels` are dropped here, on this thread
  TLOG(ERROR, "calls still hold gRPC channels; keeping them for the process's life")
      .Kv("owner", owner)
      .Kv("users", count())
      .Kv("channels", channels.size())
      .Kv("waited_s", absl::ToDoubleSeconds(timeout));
  // Deliberately never freed: see the header.
  new std::vector<std::shared_ptr<grpc::Channel>>(std::move(channels));
}

}  // namespace tandem::rpc
