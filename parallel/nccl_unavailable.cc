// NcclCommunicator in builds without CUDA (the default build): Create refuses
// with FailedPrecondition, so that code choosing a communicator at start-up
// (engine/runtime/tp_executor.cc) compiles everywhere and reports clearly.
// The class is never constructed here; its other members are unreachable.
#include "common/status.h"
#include "parallel/nccl_communicator.h"

namespace tandem::parallel {

struct NcclCommunicator::Impl {};

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclOptions& options) {
  return FailedPrecondition("nccl communicator (rank ", options.rank, " of ",
                            options.size, ", GPU ", options.device,
                            "): this binary was built without CUDA "
                            "(bazel build --config=cuda)");
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { return 0; }
int NcclCommunicator::size() const { return 1; }
absl::Duration NcclCommunicator::timeout() const { return absl::ZeroDuration(); }
void* NcclCommunicator::stream() const { return nullptr; }
void NcclCommunicator::Abort() {}
bool NcclCommunicator::abort_pending() const { return false; }
void NcclCommunicator::AbortNow() {}

absl::Status NcclCommunicator::AllReduceSum(float*, size_t) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::AllReduceSumBf16(uint16_t*, size_t) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::AllGather(const float*, size_t, float*) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::Broadcast(void*, size_t, int) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::Barrier() {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::EnqueueAllReduceSum(float*, size_t) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::EnqueueAllGather(const float*, size_t, float*) {
  return FailedPrecondition("nccl: built without CUDA");
}
absl::Status NcclCommunicator::WaitForStream() {
  return FailedPrecondition("nccl: built without CUDA");
}

}  // namespace tandem::parallel
