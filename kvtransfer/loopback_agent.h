// LoopbackAgent: an in-process TransferAgent (memcpy between agents of the same
// process) with the same semantics and errors as UcxAgent, for callers' unit tests.
// It is an AgentCore (agent_core.h: batches, waits, cancellation, callbacks,
// notifications) over the loopback backend (loopback_agent.cc), whose only
// primitives are a copy into or out of another agent's registered memory and a
// direct delivery of a notification into it.
//
// Agents find each other through a process-wide registry keyed by agent id (the
// descriptor's address). The agent's progress thread copies its batches in
// 4 MiB pieces, in batch order, checking for cancellation, a paused target and a
// dead target between pieces. Completion callbacks run on that thread;
// notification callbacks on the notifying thread (Notify returns after the
// target's callback ran, or after the notification was queued there).
//
// Fault injection for tests of callers:
//   SetPaused(true)  the agent stops accepting bytes: writes into it (and reads
//                    from it) stall, as with a stopped peer process.
//   Kill()           the agent behaves like a dead process: peers' in-flight and new
//                    operations to it fail UNAVAILABLE, Connect fails UNAVAILABLE.
#ifndef TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_
#define TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_

#include <memory>

#include "kvtransfer/agent_core.h"

namespace tandem::kvtransfer {

class LoopbackBackend;

class LoopbackAgent final : public AgentCore {
 public:
  LoopbackAgent();
  ~LoopbackAgent() override;

  // Fault injection (see the file comment).
  void SetPaused(bool paused);
  void Kill();

 private:
  explicit LoopbackAgent(LoopbackBackend* backend);  // takes ownership

  LoopbackBackend* const loopback_;  // owned by AgentCore
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_
