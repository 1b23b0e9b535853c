// The router's per-request state machine, stepped by hand: each test puts a
// request in a state, feeds it an event and checks the actions it asks for, the
// ledger, the registry and the metrics. No RPCs, no threads, a fake clock.
#include "router/placement.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"

namespace tandem::router {
namespace {

using State = Placement::State;
using Kind = Placement::Action::Kind;

tandem::v1::RegisterRequest Worker(const std::string& id, tandem::v1::WorkerRole role) {
  tandem::v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_role(role);
  r.set_grpc_address(id + ".local:1");
  r.set_model_fingerprint("fp");
  return r;
}

// "reserve d0", "release d0 (await)", "finish CANCELLED", ... joined by ", ".
std::string Str(const Placement::Actions& actions) {
  std::vector<std::string> out;
  for (const Placement::Action& a : actions) {
    const std::string& w = a.worker.registration.worker_id();
    switch (a.kind) {
      case Kind::kReserve:
        out.push_back("reserve " + w);
        break;
      case Kind::kPrefill:
        out.push_back("prefill " + w);
        break;
      case Kind::kRelease:
        out.push_back(absl::StrCat("release ", w, a.await ? " (await)" : ""));
        break;
      case Kind::kDecode:
        out.push_back("decode " + w);
        break;
      case Kind::kColocate:
        out.push_back("colocate " + w);
        break;
      case Kind::kCancelCall:
        out.push_back("cancel");
        break;
      case Kind::kQueue:
        out.push_back("queue");
        break;
      case Kind::kDequeue:
        out.push_back("dequeue");
        break;
      case Kind::kFinish:
        out.push_back("finish " + absl::StatusCodeToString(a.status.code()));
        break;
    }
  }
  return absl::StrJoin(out, ", ");
}

absl::Status Code(absl::StatusCode code) {
  return code == absl::StatusCode::kOk ? absl::OkStatus()
                                       : absl::Status(code, "from the worker");
}

class PlacementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddWorker("d0", tandem::v1::WORKER_ROLE_DECODE);
    AddWorker("d1", tandem::v1::WORKER_ROLE_DECODE);
    AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);
    AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL);
  }

  // Prefill workers write after held rows (this build's) unless told.
  void AddWorker(const std::string& id, tandem::v1::WorkerRole role,
                 const tandem::v1::WorkerLoad& load = {},
                 bool writes_after_held_prefix = true) {
    tandem::v1::RegisterRequest r = Worker(id, role);
    *r.mutable_load() = load;
    r.set_writes_after_held_prefix(role == tandem::v1::WORKER_ROLE_PREFILL &&
                                   writes_after_held_prefix);
    ASSERT_TRUE(registry_.Register(r).ok());
  }
  bool Live(const std::string& id) {
    for (auto role :
         {tandem::v1::WORKER_ROLE_PREFILL, tandem::v1::WORKER_ROLE_DECODE}) {
      for (const WorkerRecord& w : registry_.Live(role)) {
        if (w.registration.worker_id() == id) return true;
      }
    }
    return false;
  }
  // Requests the router has placed on `id` (ledger).
  int32_t Placed(const std::string& id) {
    std::vector<WorkerRecord> all = registry_.Live(tandem::v1::WORKER_ROLE_DECODE);
    for (WorkerRecord& w : registry_.Live(tandem::v1::WORKER_ROLE_PREFILL)) {
      all.push_back(w);
    }
    InFlightMap f = ledger_.Snapshot(all);
    auto it = f.find(id);
    return it == f.end() ? 0 : it->second.requests;
  }
  bool LedgerEmpty() {
    return Placed("d0") + Placed("d1") + Placed("p0") + Placed("p1") == 0;
  }
  double Retries(const char* reason) {
    return metrics_.retries->Add({{"reason", reason}}).Value();
  }
  double Paths(const char* path) {
    return metrics_.paths->Add({{"path", path}}).Value();
  }

  std::unique_ptr<Placement> Make(int32_t prompt_tokens = 10, int32_t min_tokens = 0,
                                  absl::Duration timeout = absl::Seconds(60)) {
    return std::make_unique<Placement>(
        PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
        PlacementRequest{.request_id = "req-1",
                         .prompt_tokens = prompt_tokens,
                         .min_tokens = min_tokens,
                         .deadline = clock_.Now() + timeout,
                         .started = clock_.Now()});
  }

  // Steps `p` (fresh) on the plain path into `state`; kReleasing is reached by
  // losing the first prefill worker, kColocated by a request with min_tokens.
  void Drive(Placement* p, State state) {
    if (state == State::kStart) return;
    if (state == State::kColocated) {
      ASSERT_EQ(Str(p->Start()), "colocate d0");
      return;
    }
    ASSERT_EQ(Str(p->Start()), "reserve d0");
    if (state == State::kReserving) return;
    ASSERT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p0");
    if (state == State::kPrefilling) return;
    if (state == State::kReleasing) {
      ASSERT_EQ(Str(p->OnPrefilled(absl::UnavailableError("p0 died"))),
                "release d0 (await)");
      return;
    }
    ASSERT_EQ(Str(p->OnPrefilled(absl::OkStatus())), "decode d0");
    if (state == State::kDecoding) return;
    ASSERT_EQ(Str(p->OnStreamDone(absl::OkStatus())), "finish OK");
  }
  std::unique_ptr<Placement> MakeIn(State state,
                                    absl::Duration timeout = absl::Seconds(60)) {
    auto p = Make(10, state == State::kColocated ? 1 : 0, timeout);
    Drive(p.get(), state);
    EXPECT_EQ(p->state(), state);
    return p;
  }

  // The event the call in flight in `state` produces when it ends with `status`.
  static Placement::Actions End(Placement* p, State state, const absl::Status& status) {
    switch (state) {
      case State::kStart:
        return p->Start();
      case State::kReserving:
        return p->OnReserved(status);
      case State::kPrefilling:
        return p->OnPrefilled(status);
      case State::kReleasing:
        return p->OnReleased(status);
      case State::kDecoding:
      case State::kColocated:
        return p->OnStreamDone(status);
      case State::kQueued:
        return p->OnQueueEnd(status);
      case State::kFinished:
        return p->OnStreamDone(status);
    }
    return {};
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Hours(1)};
  PlacementLedger ledger_;
  metrics::Registry metric_registry_;
  HandoffMetrics metrics_{&metric_registry_};
  HandoffOptions options_;
};

TEST_F(PlacementTest, DisaggregatedPathReservesPrefillsDecodesAndFinishesOnce) {
  auto p = Make();
  const absl::Time t0 = clock_.Now();
  Placement::Actions a = p->Start();
  ASSERT_EQ(Str(a), "reserve d0");
  EXPECT_EQ(a[0].deadline, t0 + options_.rpc_timeout);  // Reserve: rpc_timeout
  EXPECT_EQ(p->state(), State::kReserving);
  EXPECT_TRUE(LedgerEmpty());  // nothing reserved yet

  a = p->OnReserved(absl::OkStatus());
  ASSERT_EQ(Str(a), "prefill p0");
  EXPECT_EQ(a[0].deadline, t0 + absl::Seconds(60));  // the request's deadline
  EXPECT_EQ(Placed("d0"), 1);
  EXPECT_EQ(Placed("p0"), 1);
  EXPECT_EQ(p->prefill_attempts(), 1);

  clock_.Advance(absl::Seconds(2));
  a = p->OnPrefilled(absl::OkStatus());
  ASSERT_EQ(Str(a), "decode d0");
  EXPECT_EQ(a[0].deadline, t0 + absl::Seconds(60));
  EXPECT_EQ(Placed("p0"), 0);
  EXPECT_EQ(Placed("d0"), 1);  // until d0's next load report or the end
  EXPECT_EQ(Paths("disaggregated"), 1);
  EXPECT_EQ(Paths("colocated"), 0);

  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(metrics_.latency->Count(), 0u);
  EXPECT_EQ(Str(p->OnStreamDone(absl::OkStatus())), "finish OK");
  EXPECT_EQ(p->state(), State::kFinished);
  EXPECT_TRUE(LedgerEmpty());
  EXPECT_EQ(metrics_.latency->Count(), 1u);
  EXPECT_DOUBLE_EQ(metrics_.latency->Sum(), 3.0);

  // Whatever comes later is ignored: one Finish, one latency sample.
  EXPECT_EQ(Str(p->OnStreamDone(absl::OkStatus())), "");
  EXPECT_EQ(Str(p->OnReserved(absl::OkStatus())), "");
  EXPECT_EQ(Str(p->OnPrefilled(absl::OkStatus())), "");
  EXPECT_EQ(Str(p->OnReleased(absl::OkStatus())), "");
  EXPECT_EQ(Str(p->Cancel()), "");
  EXPECT_EQ(Str(p->Start()), "");
  EXPECT_EQ(metrics_.latency->Count(), 1u);
}

struct ColocateCase {
  const char* name;
  int32_t colocate_below;
  int64_t max_context;
  int32_t prompt;
  int32_t min_tokens;
  bool prefill_workers;
  std::string want;
};

TEST_F(PlacementTest, ColocateRulesTable) {
  const std::vector<ColocateCase> cases = {
      {"default: disaggregated", 0, 0, 10, 0, true, "reserve d0"},
      {"prompt below the threshold", 11, 0, 10, 0, true, "colocate d0"},
      {"prompt at the threshold", 10, 0, 10, 0, true, "reserve d0"},
      {"min_tokens", 0, 0, 10, 1, true, "colocate d0"},
      {"no room after the prompt", 0, 11, 10, 0, true, "colocate d0"},
      {"room for one token", 0, 12, 10, 0, true, "reserve d0"},
      {"no prefill worker", 0, 0, 10, 0, false, "colocate d0"},
  };
  for (const ColocateCase& c : cases) {
    SCOPED_TRACE(c.name);
    if (!c.prefill_workers) {
      registry_.Remove("p0");
      registry_.Remove("p1");
    }
    options_.colocate_below_tokens = c.colocate_below;
    options_.max_context_tokens = c.max_context;
    auto p = Make(c.prompt, c.min_tokens);
    EXPECT_EQ(Str(p->Start()), c.want);
    if (c.want == "colocate d0") {
      EXPECT_EQ(p->state(), State::kColocated);
      EXPECT_TRUE(LedgerEmpty());  // a colocated request reserves nothing
    }
    AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);
    AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL);
  }
  EXPECT_EQ(Paths("colocated"), 4);
}

struct StepCase {
  const char* name;
  State state;                 // where the request is
  std::string want_on_event;   // actions of the interrupting event (cancel)
  absl::StatusCode call_ends;  // then the call in flight ends with this
  std::string want_at_end;     // and the actions of that end
};

TEST_F(PlacementTest, ClientCancelInEachState) {
  using C = absl::StatusCode;
  const std::vector<StepCase> cases = {
      {"start: Start finishes", State::kStart, "", C::kOk, "finish CANCELLED"},
      {"reserving", State::kReserving, "cancel", C::kCancelled,
       "release d0, finish CANCELLED"},
      {"reserving, the reservation won the race", State::kReserving, "cancel", C::kOk,
       "release d0, finish CANCELLED"},
      {"prefilling", State::kPrefilling, "cancel", C::kCancelled,
       "release d0, finish CANCELLED"},
      {"prefilling, prefill won the race", State::kPrefilling, "cancel", C::kOk,
       "release d0, finish CANCELLED"},
      {"releasing: no call to cancel", State::kReleasing, "finish CANCELLED", C::kOk,
       ""},
      {"decoding", State::kDecoding, "cancel", C::kCancelled, "finish CANCELLED"},
      {"decoding, the stream ended first", State::kDecoding, "cancel", C::kOk,
       "finish OK"},
      {"colocated", State::kColocated, "cancel", C::kCancelled, "finish CANCELLED"},
      {"finished: nothing", State::kFinished, "", C::kOk, ""},
  };
  for (const StepCase& c : cases) {
    SCOPED_TRACE(c.name);
    const uint64_t finished_before = metrics_.latency->Count();
    auto p = MakeIn(c.state);
    EXPECT_EQ(Str(p->Cancel()), c.want_on_event);
    EXPECT_EQ(Str(p->Cancel()), "");  // a second cancel changes nothing
    EXPECT_EQ(Str(End(p.get(), c.state, Code(c.call_ends))), c.want_at_end);
    EXPECT_EQ(p->state(), State::kFinished);
    EXPECT_TRUE(p->cancelled() || c.state == State::kFinished);
    EXPECT_EQ(metrics_.latency->Count(), finished_before + 1);  // once per request
    EXPECT_TRUE(LedgerEmpty());
    EXPECT_TRUE(Live("d0"));  // a cancel is not a lost worker
    EXPECT_TRUE(Live("d1"));
    // kReleasing was reached by losing p0; bring it back for the next case.
    if (!Live("p0")) AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);
  }
}

TEST_F(PlacementTest, DeadlineInEachState) {
  using C = absl::StatusCode;
  // The clock passes the request's deadline while the request is in `state`;
  // then the call in flight ends (DEADLINE_EXCEEDED: gRPC enforced the deadline
  // it carried; OK: it ended just before), and no further call starts.
  const std::vector<StepCase> cases = {
      {"start", State::kStart, "", C::kOk, "finish DEADLINE_EXCEEDED"},
      {"reserving", State::kReserving, "", C::kDeadlineExceeded,
       "release d0, finish DEADLINE_EXCEEDED"},
      {"reserving, reserved just before", State::kReserving, "", C::kOk,
       "release d0, finish DEADLINE_EXCEEDED"},
      {"prefilling", State::kPrefilling, "", C::kDeadlineExceeded,
       "release d0, finish DEADLINE_EXCEEDED"},
      {"prefilling, prefilled just before", State::kPrefilling, "", C::kOk,
       "release d0, finish DEADLINE_EXCEEDED"},
      {"releasing: no new Reserve", State::kReleasing, "", C::kOk,
       "finish DEADLINE_EXCEEDED"},
      {"decoding", State::kDecoding, "", C::kDeadlineExceeded,
       "finish DEADLINE_EXCEEDED"},
      {"decoding, the stream ended just before", State::kDecoding, "", C::kOk,
       "finish OK"},
      {"colocated", State::kColocated, "", C::kDeadlineExceeded,
       "finish DEADLINE_EXCEEDED"},
  };
  for (const StepCase& c : cases) {
    SCOPED_TRACE(c.name);
    auto p = MakeIn(c.state, absl::Seconds(10));
    clock_.Advance(absl::Seconds(11));
    EXPECT_EQ(Str(End(p.get(), c.state, Code(c.call_ends))), c.want_at_end);
    EXPECT_EQ(p->state(), State::kFinished);
    EXPECT_TRUE(LedgerEmpty());
    EXPECT_TRUE(Live("d0"));
    if (c.state == State::kReleasing) AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);
  }
  EXPECT_EQ(metrics_.latency->Count(), cases.size());
}

TEST_F(PlacementTest, CallsCarryTheRequestDeadlineAndReleaseItsOwn) {
  auto p = Make(10, 0, absl::Seconds(2));  // shorter than rpc_timeout
  const absl::Time t0 = clock_.Now();
  Placement::Actions a = p->Start();
  ASSERT_EQ(Str(a), "reserve d0");
  EXPECT_EQ(a[0].deadline, t0 + absl::Seconds(2));
  a = p->OnReserved(absl::OkStatus());
  ASSERT_EQ(Str(a), "prefill p0");
  EXPECT_EQ(a[0].deadline, t0 + absl::Seconds(2));
  clock_.Advance(absl::Seconds(1));
  a = p->OnPrefilled(absl::InternalError("boom"));
  ASSERT_EQ(Str(a), "release d0, finish INTERNAL");
  // The Release is bounded by rpc_timeout from now, not by the request.
  EXPECT_EQ(a[0].deadline, clock_.Now() + options_.rpc_timeout);
  EXPECT_EQ(a[1].status.message(), "boom");
}

struct LossCase {
  const char* name;
  State state;
  std::string want;     // actions after UNAVAILABLE from the worker called
  std::string removed;  // the worker dropped from the registry ("" none)
  const char* retry_reason;
};

TEST_F(PlacementTest, PeerLossInEachState) {
  const std::vector<LossCase> cases = {
      {"reserving: next decode worker", State::kReserving, "reserve d1", "d0",
       "decode_unavailable"},
      {"prefilling: release, then reserve again", State::kPrefilling,
       "release d0 (await)", "p0", "prefill_unavailable"},
      {"releasing: the lease frees it, go on", State::kReleasing, "reserve d0", "",
       nullptr},
      {"decoding: the request fails", State::kDecoding, "finish UNAVAILABLE", "d0",
       nullptr},
      {"colocated: the request fails", State::kColocated, "finish UNAVAILABLE", "d0",
       nullptr},
  };
  for (const LossCase& c : cases) {
    SCOPED_TRACE(c.name);
    const double retries_before = c.retry_reason ? Retries(c.retry_reason) : 0;
    auto p = MakeIn(c.state);
    Placement::Actions a = End(p.get(), c.state, absl::UnavailableError("gone"));
    EXPECT_EQ(Str(a), c.want);
    if (!c.removed.empty()) {
      EXPECT_FALSE(Live(c.removed));
    }
    EXPECT_TRUE(Live("d1"));
    if (c.retry_reason) {
      EXPECT_EQ(Retries(c.retry_reason), retries_before + 1);
    }
    if (c.want == "finish UNAVAILABLE") {
      // The error names the worker and its address.
      EXPECT_NE(a[0].status.message().find("decode worker d0 (d0.local:1)"),
                std::string::npos)
          << a[0].status;
      EXPECT_TRUE(LedgerEmpty());
    }
    // Back to four live workers for the next case.
    if (!Live("d0")) AddWorker("d0", tandem::v1::WORKER_ROLE_DECODE);
    if (!Live("p0")) AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);
  }
}

TEST_F(PlacementTest, LostPrefillWorkerIsExcludedOnTheRetry) {
  auto p = MakeIn(State::kPrefilling);
  ASSERT_EQ(Str(p->OnPrefilled(absl::UnavailableError("gone"))), "release d0 (await)");
  EXPECT_EQ(Placed("d0"), 0);  // released: no longer counted against d0
  AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL);  // back, but tried already
  ASSERT_EQ(Str(p->OnReleased(absl::OkStatus())), "reserve d0");
  EXPECT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p1");
  EXPECT_EQ(p->prefill_attempts(), 2);
  EXPECT_EQ(Str(p->OnPrefilled(absl::OkStatus())), "decode d0");
}

TEST_F(PlacementTest, PrefillRetriesStopAtMaxAttempts) {
  options_.max_prefill_attempts = 2;
  auto p = MakeIn(State::kPrefilling);
  ASSERT_EQ(Str(p->OnPrefilled(absl::UnavailableError("p0 gone"))),
            "release d0 (await)");
  ASSERT_EQ(Str(p->OnReleased(absl::OkStatus())), "reserve d0");
  ASSERT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p1");
  Placement::Actions a = p->OnPrefilled(absl::UnavailableError("p1 gone"));
  ASSERT_EQ(Str(a), "release d0, finish UNAVAILABLE");
  EXPECT_EQ(a[1].status.message(), "prefill failed on 2 workers; last (p1): p1 gone");
  EXPECT_EQ(Retries("prefill_unavailable"), 2);
  EXPECT_FALSE(Live("p0"));
  EXPECT_FALSE(Live("p1"));
  EXPECT_TRUE(LedgerEmpty());
}

TEST_F(PlacementTest, NoPrefillWorkerLeftFallsBackToColocated) {
  registry_.Remove("p1");
  auto p = MakeIn(State::kPrefilling);
  ASSERT_EQ(Str(p->OnPrefilled(absl::UnavailableError("gone"))), "release d0 (await)");
  ASSERT_EQ(Str(p->OnReleased(absl::OkStatus())), "reserve d0");
  // Reserved again, but no prefill worker is left: release, then colocate.
  ASSERT_EQ(Str(p->OnReserved(absl::OkStatus())), "release d0 (await)");
  EXPECT_EQ(p->state(), State::kReleasing);
  EXPECT_EQ(Retries("colocated_fallback"), 1);
  EXPECT_EQ(Placed("d0"), 0);
  ASSERT_EQ(Str(p->OnReleased(absl::OkStatus())), "colocate d0");
  EXPECT_EQ(Paths("colocated"), 1);
  EXPECT_EQ(Paths("disaggregated"), 0);
  EXPECT_EQ(Str(p->OnStreamDone(absl::OkStatus())), "finish OK");
}

TEST_F(PlacementTest, FullDecodeWorkersAreSkippedThenQueued) {
  auto p = MakeIn(State::kReserving);
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  Placement::Actions a = p->OnReserved(absl::ResourceExhaustedError("full"));
  ASSERT_EQ(Str(a), "queue");
  EXPECT_EQ(a[0].deadline, clock_.Now() + absl::Seconds(60));  // the request's
  EXPECT_EQ(p->state(), State::kQueued);
  EXPECT_EQ(Retries("decode_full"), 2);
  EXPECT_TRUE(Live("d0"));  // full is not lost
  EXPECT_TRUE(Live("d1"));
  EXPECT_TRUE(LedgerEmpty());
  EXPECT_EQ(metrics_.latency->Count(), 0u);  // not finished
}

TEST_F(PlacementTest, OneFullOneLostIsQueued) {
  auto p = MakeIn(State::kReserving);
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  EXPECT_EQ(Str(p->OnReserved(absl::UnavailableError("gone"))), "queue");
  EXPECT_FALSE(Live("d1"));
}

TEST_F(PlacementTest, CapacityFreedRetriesEveryWorkerFromTheQueue) {
  auto p = MakeIn(State::kReserving);
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "queue");
  clock_.Advance(absl::Seconds(3));
  // Woken: d0 and d1 are candidates again; still full: back to the queue.
  ASSERT_EQ(Str(p->OnQueueEnd(absl::OkStatus())), "reserve d0");
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "queue");
  // Woken again, and d0 has room now.
  ASSERT_EQ(Str(p->OnQueueEnd(absl::OkStatus())), "reserve d0");
  ASSERT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p0");
  ASSERT_EQ(Str(p->OnPrefilled(absl::OkStatus())), "decode d0");
  EXPECT_EQ(Str(p->OnStreamDone(absl::OkStatus())), "finish OK");
  EXPECT_DOUBLE_EQ(metrics_.latency->Sum(), 3.0);       // the wait counts
  EXPECT_EQ(Str(p->OnQueueEnd(absl::OkStatus())), "");  // late: ignored
}

TEST_F(PlacementTest, QueueEndsTable) {
  struct Case {
    const char* name;
    absl::Status end;
    std::string want;
    const char* message;  // in the Finish status
  };
  const std::vector<Case> cases = {
      {"queue full", absl::ResourceExhaustedError("the router's queue is full"),
       "finish RESOURCE_EXHAUSTED",
       "every decode worker is full and the router's queue"},
      {"queue timeout", absl::ResourceExhaustedError("no capacity freed"),
       "finish RESOURCE_EXHAUSTED", "no capacity freed"},
      {"deadline while queued", absl::DeadlineExceededError("deadline passed"),
       "finish DEADLINE_EXCEEDED", "deadline passed"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto p = MakeIn(State::kReserving);
    ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
    ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "queue");
    Placement::Actions a = p->OnQueueEnd(c.end);
    ASSERT_EQ(Str(a), c.want);
    EXPECT_NE(a[0].status.message().find(c.message), std::string::npos)
        << a[0].status.message();
    EXPECT_EQ(p->state(), State::kFinished);
    EXPECT_TRUE(LedgerEmpty());
  }
}

TEST_F(PlacementTest, CancelWhileQueuedLeavesTheQueueAtOnce) {
  auto p = MakeIn(State::kReserving);
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "queue");
  EXPECT_EQ(Str(p->Cancel()), "dequeue, finish CANCELLED");
  EXPECT_EQ(Str(p->OnQueueEnd(absl::OkStatus())), "");  // a racing wake: ignored
  EXPECT_EQ(metrics_.latency->Count(), 1u);
}

TEST_F(PlacementTest, DeadlinePassedWhileQueuedEndsOnWake) {
  auto p = MakeIn(State::kReserving, absl::Seconds(5));
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "reserve d1");
  ASSERT_EQ(Str(p->OnReserved(absl::ResourceExhaustedError("full"))), "queue");
  clock_.Advance(absl::Seconds(5));
  Placement::Actions a = p->OnQueueEnd(absl::OkStatus());
  ASSERT_EQ(Str(a), "finish DEADLINE_EXCEEDED");
  EXPECT_NE(a[0].status.message().find("RESERVING"), std::string::npos);
}

TEST_F(PlacementTest, EveryDecodeWorkerLostIsUnavailable) {
  auto p = MakeIn(State::kReserving);
  ASSERT_EQ(Str(p->OnReserved(absl::UnavailableError("gone"))), "reserve d1");
  Placement::Actions a = p->OnReserved(absl::UnavailableError("gone"));
  ASSERT_EQ(Str(a), "finish UNAVAILABLE");
  EXPECT_NE(a[0].status.message().find("no decode worker can take this request"),
            std::string::npos);
  EXPECT_EQ(Retries("decode_unavailable"), 2);
}

TEST_F(PlacementTest, DecodeWorkersWithoutRoomQueueAtOnceAndColocateAgainWhenWoken) {
  tandem::v1::WorkerLoad full;
  full.set_total_kv_blocks(10);
  full.set_free_kv_blocks(0);
  AddWorker("d0", tandem::v1::WORKER_ROLE_DECODE, full);  // replaces the records
  AddWorker("d1", tandem::v1::WORKER_ROLE_DECODE, full);
  auto p = Make();
  EXPECT_EQ(Str(p->Start()), "queue");  // no Reserve: the reports say full
  EXPECT_EQ(metrics_.latency->Count(), 0u);
  auto c = Make(10, /*min_tokens=*/1);
  EXPECT_EQ(Str(c->Start()), "queue");
  tandem::v1::WorkerLoad room;
  room.set_total_kv_blocks(10);
  room.set_free_kv_blocks(10);
  room.set_kv_block_size(16);
  room.set_free_state_slots(1);
  room.set_total_state_slots(1);
  ASSERT_TRUE(registry_.Heartbeat("d1", room));
  EXPECT_EQ(Str(c->OnQueueEnd(absl::OkStatus())), "colocate d1");  // as it began
  EXPECT_EQ(Str(p->OnQueueEnd(absl::OkStatus())), "reserve d1");
}

// A request finishing on a full worker frees its room at once for a request
// queued for it: the ledger credits it, so the woken request reserves there
// without waiting for the worker's next load report (heartbeat).
TEST_F(PlacementTest, RoomFreedByAFinishedRequestIsUsedBeforeTheNextReport) {
  ASSERT_TRUE(registry_.Remove("d1"));
  tandem::v1::WorkerLoad one;  // one slot, free
  one.set_total_kv_blocks(100);
  one.set_free_kv_blocks(100);
  one.set_kv_block_size(16);
  one.set_total_state_slots(1);
  one.set_free_state_slots(1);
  AddWorker("d0", tandem::v1::WORKER_ROLE_DECODE, one);
  auto a = Make();
  Drive(a.get(), State::kDecoding);   // "a" runs on d0
  tandem::v1::WorkerLoad full = one;  // d0's report now counts it
  full.set_free_state_slots(0);
  full.set_free_kv_blocks(99);
  ASSERT_TRUE(registry_.Heartbeat("d0", full));
  auto b = std::make_unique<Placement>(
      PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
      PlacementRequest{.request_id = "req-2",
                       .prompt_tokens = 10,
                       .deadline = clock_.Now() + absl::Seconds(60),
                       .started = clock_.Now()});
  EXPECT_EQ(Str(b->Start()), "queue");
  // Woken while "a" still runs (another request ended elsewhere): no room.
  EXPECT_EQ(Str(b->OnQueueEnd(absl::OkStatus())), "queue");
  EXPECT_EQ(Str(a->OnStreamDone(absl::OkStatus())), "finish OK");
  EXPECT_EQ(Placed("d0"), -1);  // the credit, until d0's next report
  EXPECT_EQ(Str(b->OnQueueEnd(absl::OkStatus())), "reserve d0");
  EXPECT_EQ(Str(b->OnReserved(absl::OkStatus())), "prefill p0");
  // The next report shows "a" gone and "b" reserved: the credit is dropped.
  ASSERT_TRUE(registry_.Heartbeat("d0", full));
  EXPECT_EQ(Placed("d0"), 0);
}

// A draining worker (shutting down, load.draining) gets no new request: the
// others are chosen; with every decode worker draining a request queues (a
// replacement may register) instead of failing; requests already placed on a
// draining worker finish there and are credited as usual.
TEST_F(PlacementTest, DrainingWorkersGetNoNewRequests) {
  auto before = Make();
  EXPECT_EQ(Str(before->Start()), "reserve d0");  // the lowest id among equals
  EXPECT_EQ(Str(before->OnReserved(absl::OkStatus())), "prefill p0");
  tandem::v1::WorkerLoad draining;
  draining.set_draining(true);
  ASSERT_TRUE(registry_.Heartbeat("d0", draining));
  ASSERT_TRUE(registry_.Heartbeat("p0", draining));
  EXPECT_EQ(registry_.Live(tandem::v1::WORKER_ROLE_DECODE).size(), 2u);
  EXPECT_EQ(registry_.Available(tandem::v1::WORKER_ROLE_DECODE).size(), 1u);
  auto p = Make();
  EXPECT_EQ(Str(p->Start()), "reserve d1");
  EXPECT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p1");
  auto c = Make(10, /*min_tokens=*/1);  // colocated
  EXPECT_EQ(Str(c->Start()), "colocate d1");
  ASSERT_TRUE(registry_.Heartbeat("d1", draining));
  auto q = Make();
  EXPECT_EQ(Str(q->Start()), "queue");
  // The request placed before the drain still completes on d0.
  EXPECT_EQ(Str(before->OnPrefilled(absl::OkStatus())), "decode d0");
  EXPECT_EQ(Str(before->OnStreamDone(absl::OkStatus())), "finish OK");
  // d1 back (e.g. a new pod with the same id): the queued request goes there.
  ASSERT_TRUE(registry_.Heartbeat("d1", {}));
  EXPECT_EQ(Str(q->OnQueueEnd(absl::OkStatus())), "reserve d1");
}

TEST(ReservationLeaseTest, CoversTheRequestUpToItsDeadline) {
  const absl::Time now = absl::FromUnixSeconds(1000);
  EXPECT_EQ(ReservationLeaseMs(now + absl::Seconds(600), now, 30000), 600000);
  EXPECT_EQ(ReservationLeaseMs(now + absl::Seconds(1), now, 30000), 30000);  // at least
  EXPECT_EQ(ReservationLeaseMs(now - absl::Seconds(1), now, 30000), 30000);
  EXPECT_EQ(ReservationLeaseMs(absl::InfiniteFuture(), now, 30000), 2147483647);
  EXPECT_EQ(ReservationLeaseMs(now + absl::Hours(24 * 30), now, 30000), 2147483647);
}

TEST_F(PlacementTest, NoDecodeWorkerAliveIsUnavailableNotQueued) {
  ASSERT_TRUE(registry_.Remove("d0"));
  ASSERT_TRUE(registry_.Remove("d1"));
  auto p = Make();
  EXPECT_EQ(Str(p->Start()), "finish UNAVAILABLE");
}

TEST_F(PlacementTest, OtherErrorsEndTheRequestWithoutRetry) {
  {
    auto p = MakeIn(State::kReserving);
    EXPECT_EQ(Str(p->OnReserved(absl::InvalidArgumentError("bad"))),
              "finish INVALID_ARGUMENT");  // nothing was reserved: no Release
  }
  {
    auto p = MakeIn(State::kPrefilling);
    EXPECT_EQ(Str(p->OnPrefilled(absl::DataLossError("checksum"))),
              "release d0, finish DATA_LOSS");
  }
  {
    auto p = MakeIn(State::kDecoding);
    EXPECT_EQ(Str(p->OnStreamDone(absl::DataLossError("checksum"))),
              "finish DATA_LOSS");
    EXPECT_TRUE(Live("d0"));
  }
  EXPECT_EQ(Retries("decode_full") + Retries("decode_unavailable") +
                Retries("prefill_unavailable") + Retries("colocated_fallback"),
            0);
  EXPECT_TRUE(LedgerEmpty());
}

TEST_F(PlacementTest, PlacementsSteerTheNextRequestBeforeLoadReports) {
  // d0 and d1 look the same in their reports; a request reserving on d0 makes
  // the next one pick d1 (the most free cache once the ledger is counted).
  tandem::v1::WorkerLoad load;
  load.set_total_kv_blocks(100);
  load.set_free_kv_blocks(100);
  load.set_kv_block_size(1);
  AddWorker("d0", tandem::v1::WORKER_ROLE_DECODE, load);
  AddWorker("d1", tandem::v1::WORKER_ROLE_DECODE, load);
  auto first = Make(20);
  ASSERT_EQ(Str(first->Start()), "reserve d0");
  ASSERT_EQ(Str(first->OnReserved(absl::OkStatus())), "prefill p0");
  auto second = Make(20);
  EXPECT_EQ(Str(second->Start()), "reserve d1");
  EXPECT_EQ(Str(second->OnReserved(absl::OkStatus())), "prefill p1");  // p0 busy
}

TEST(PlacementStateNameTest, EveryState) {
  EXPECT_STREQ(PlacementStateName(State::kStart), "START");
  EXPECT_STREQ(PlacementStateName(State::kReserving), "RESERVING");
  EXPECT_STREQ(PlacementStateName(State::kPrefilling), "PREFILLING");
  EXPECT_STREQ(PlacementStateName(State::kReleasing), "RELEASING");
  EXPECT_STREQ(PlacementStateName(State::kDecoding), "DECODING");
  EXPECT_STREQ(PlacementStateName(State::kColocated), "COLOCATED");
  EXPECT_STREQ(PlacementStateName(State::kQueued), "QUEUED");
  EXPECT_STREQ(PlacementStateName(State::kFinished), "FINISHED");
}

}  // namespace
}  // namespace tandem::router

namespace tandem::router {
namespace {

// Cache-aware prefill routing through Placement: a prompt whose prefix the
// router sent to p1 goes to p1 although p0 sorts first; another goes by load.
TEST_F(PlacementTest, CacheAwareRouterSendsAPrefixBackToItsWorker) {
  PrefillRouter router(RoutingPolicy::kCacheAware, CacheAwareOptions{}, &clock_);
  // Both report their caches (nothing yet).
  for (const char* id : {"p0", "p1"}) {
    tandem::v1::RegisterRequest r = Worker(id, tandem::v1::WORKER_ROLE_PREFILL);
    r.set_reports_prefix_cache(true);
    r.set_prefix_epoch(1);
    router.OnRegister(r);
  }
  std::vector<int32_t> prompt(640);
  for (int i = 0; i < 640; ++i) prompt[i] = i * 13 % 4093;
  const std::vector<uint64_t> hashes = RouterBlockHashes(prompt, "");
  // An earlier request of this prefix went to p1 (p0 excluded then): p1 has
  // not reported it yet, the router's overlay counts its last full chunk.
  router.Select(registry_.Live(tandem::v1::WORKER_ROLE_PREFILL), {"p0"}, {}, 640,
                hashes);
  auto make = [&](std::vector<uint64_t> h) {
    return std::make_unique<Placement>(
        PlacementDeps{&registry_, &ledger_, &metrics_, &clock_, &router}, options_,
        PlacementRequest{.request_id = "req-ca",
                         .prompt_tokens = 640,
                         .deadline = clock_.Now() + absl::Seconds(60),
                         .started = clock_.Now(),
                         .prefix_hashes = std::move(h)});
  };
  auto p = make(hashes);
  ASSERT_EQ(Str(p->Start()), "reserve d0");
  EXPECT_EQ(Str(p->OnReserved(absl::OkStatus())), "prefill p1");
  std::vector<int32_t> other(640, 7);
  auto q = make(RouterBlockHashes(other, ""));
  ASSERT_EQ(Str(q->Start()), "reserve d1");  // d0 holds the first one
  // p1 now has this request's 640 tokens in flight: p0 (no load) wins.
  EXPECT_EQ(Str(q->OnReserved(absl::OkStatus())), "prefill p0");
  // The decisions, counted by policy and reason: the cached prefix decided the
  // first (576 tokens estimated held: its last full chunk below the last
  // token), load the second.
  auto choices = [&](const char* reason) {
    return metrics_.prefill_choices
        ->Add({{"policy", "cache_aware"}, {"reason", reason}})
        .Value();
  };
  EXPECT_EQ(choices("cache"), 1);
  EXPECT_EQ(choices("load"), 1);
  EXPECT_EQ(choices("balance"), 0);
  EXPECT_EQ(metrics_.estimated_hit_tokens->Value(), 576);
}

// Conditional disaggregation by the uncached length: the prompt less the
// deepest prefix a decode worker reported.
TEST_F(PlacementTest, ColocatesByTheUncachedLength) {
  std::vector<int32_t> prompt(2000);
  for (int i = 0; i < 2000; ++i) prompt[i] = i * 29 % 4093;
  const std::vector<uint64_t> h = RouterBlockHashes(prompt, "");
  auto stored = [&](int blocks) {
    tandem::v1::PrefixCacheEvent e;
    e.set_kind(tandem::v1::PrefixCacheEvent::KIND_STORED);
    e.set_tokens(blocks * 64);
    e.set_route_hash(h[blocks - 1]);
    return e;
  };
  struct Case {
    const char* name;
    int32_t colocate_below;
    int d1_blocks;  // d1 reported the prompt's first this many blocks (0: none)
    bool d1_reports;
    std::string want;
    // d1 announced those blocks in its device tier too (blocks_only), as a
    // decode worker does for a prompt it computed; false: the usable
    // position alone (its blocks may sit in d1's host tier).
    bool d1_device_blocks = true;
  };
  const std::vector<Case> cases = {
      {"no report: the prompt's length decides", 512, 0, true, "reserve d0"},
      // 2000 - 1920 = 80 uncached < 512: prefilled on d1, which holds the rest
      // (d0 sorts first and has as much room).
      {"a short uncached suffix on d1", 512, 30, true, "colocate d1"},
      // Disaggregated, the reservation goes where the prompt's rows are (a
      // decode-side prefix hit: d1 announced the blocks; d0 has as much room).
      {"the uncached part at the threshold", 80, 30, true, "reserve d1"},
      {"the uncached part above it", 512, 20, true, "reserve d1"},  // 720 left
      {"threshold 0: always disaggregated", 0, 30, true, "reserve d1"},
      {"d1 does not report", 512, 30, false, "reserve d0"},
      // A usable position is no holding of blocks a reservation can share:
      // by room and id.
      {"a usable position alone", 0, 30, true, "reserve d0", false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    PrefillRouter router(RoutingPolicy::kCacheAware, CacheAwareOptions{}, &clock_);
    tandem::v1::RegisterRequest r = Worker("d1", tandem::v1::WORKER_ROLE_DECODE);
    r.set_reports_prefix_cache(c.d1_reports);
    r.set_prefix_epoch(1);
    if (c.d1_blocks > 0) {
      *r.add_prefix_snapshot() = stored(c.d1_blocks);
      if (c.d1_device_blocks) {
        tandem::v1::PrefixCacheEvent* e = r.add_prefix_snapshot();
        *e = stored(c.d1_blocks);
        e->set_blocks_only(true);
      }
    }
    router.OnRegister(r);
    options_.colocate_below_tokens = c.colocate_below;
    Placement p(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_, &router},
                options_,
                PlacementRequest{.request_id = "req-u",
                                 .prompt_tokens = 2000,
                                 .deadline = clock_.Now() + absl::Seconds(60),
                                 .started = clock_.Now(),
                                 .prefix_hashes = h});
    EXPECT_EQ(Str(p.Start()), c.want);
    if (c.want == "colocate d1") {
      // The colocated prompt is overlaid on d1 (its prefill there).
      EXPECT_EQ(router.Match("d1", RouterBlockHashes(prompt, ""), 2000), 1984);
    }
  }
  EXPECT_EQ(Paths("colocated"), 1);
}

// The router's default (--colocate_below_tokens = kDefaultColocateBelowTokens,
// what `./tandem up` runs with): a short prompt is prefilled on a decode
// worker, a long one disaggregated, and a long one whose uncached part is short
// goes to the decode worker holding the rest.
TEST_F(PlacementTest, TheRoutersDefaultColocatesShortPromptsOnly) {
  EXPECT_EQ(kDefaultColocateBelowTokens, 1000);
  EXPECT_EQ(HandoffOptions{}.colocate_below_tokens, 0);  // the library's: never
  options_.colocate_below_tokens = kDefaultColocateBelowTokens;
  std::vector<int32_t> prompt(3000);
  for (int i = 0; i < 3000; ++i) prompt[i] = i * 31 % 4093;
  struct Case {
    const char* name;
    int32_t prompt;
    int d1_blocks;  // d1 reported the prompt's first this many 64-token blocks
    std::string want;
  };
  const std::vector<Case> cases = {
      {"a chat message", 40, 0, "colocate d0"},
      {"just below the default", 999, 0, "colocate d0"},
      {"at the default", 1000, 0, "reserve d0"},
      {"a long prompt", 3000, 0, "reserve d0"},
      // 3000 - 40 * 64 = 440 uncached: on d1, which holds the rest.
      {"a long prompt, short uncached suffix", 3000, 40, "colocate d1"},
      // 3000 - 30 * 64 = 1080 uncached: disaggregated, reserved on d1, which
      // holds the first 1920 tokens' rows (a decode-side prefix hit).
      {"a long prompt, long uncached suffix", 3000, 30, "reserve d1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<int32_t> tokens(prompt.begin(), prompt.begin() + c.prompt);
    const std::vector<uint64_t> h = RouterBlockHashes(tokens, "");
    PrefillRouter router(RoutingPolicy::kCacheAware, CacheAwareOptions{}, &clock_);
    tandem::v1::RegisterRequest r = Worker("d1", tandem::v1::WORKER_ROLE_DECODE);
    r.set_reports_prefix_cache(true);
    r.set_prefix_epoch(1);
    if (c.d1_blocks > 0) {
      // A usable position and its blocks in d1's device tier.
      for (bool blocks_only : {false, true}) {
        tandem::v1::PrefixCacheEvent* e = r.add_prefix_snapshot();
        e->set_kind(tandem::v1::PrefixCacheEvent::KIND_STORED);
        e->set_tokens(c.d1_blocks * 64);
        e->set_route_hash(h[c.d1_blocks - 1]);
        e->set_blocks_only(blocks_only);
      }
    }
    router.OnRegister(r);
    Placement p(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_, &router},
                options_,
                PlacementRequest{.request_id = "req-default",
                                 .prompt_tokens = c.prompt,
                                 .deadline = clock_.Now() + absl::Seconds(60),
                                 .started = clock_.Now(),
                                 .prefix_hashes = h});
    EXPECT_EQ(Str(p.Start()), c.want);
    EXPECT_EQ(p.state(),
              c.want.rfind("reserve", 0) == 0 ? State::kReserving : State::kColocated);
  }
  EXPECT_EQ(Paths("colocated"), 3);
  // An image prompt below it is still disaggregated (the tower runs on the
  // prefill worker).
  Placement image(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
                  PlacementRequest{.request_id = "req-image",
                                   .prompt_tokens = 40,
                                   .deadline = clock_.Now() + absl::Seconds(60),
                                   .started = clock_.Now(),
                                   .has_images = true});
  EXPECT_EQ(Str(image.Start()), "reserve d0");
}

// Rolling upgrades: a decode worker shares cached blocks (and the prefill
// worker skips their rows) only for a prefill worker that registered
// writes_after_held_prefix; an older one writes every row from 0 and would
// overwrite rows other sequences share.
TEST_F(PlacementTest, SharingNeedsAPrefillWorkerThatWritesAfterHeldRows) {
  std::vector<int32_t> prompt(640);
  for (int i = 0; i < 640; ++i) prompt[i] = i * 17 % 4093;
  const std::vector<uint64_t> h = RouterBlockHashes(prompt, "");
  // d1 holds the prompt's first 512 tokens' blocks (d0 sorts first, same room).
  tandem::v1::RegisterRequest d1 = Worker("d1", tandem::v1::WORKER_ROLE_DECODE);
  d1.set_reports_prefix_cache(true);
  d1.set_prefix_epoch(1);
  tandem::v1::PrefixCacheEvent* e = d1.add_prefix_snapshot();
  e->set_kind(tandem::v1::PrefixCacheEvent::KIND_STORED);
  e->set_tokens(512);
  e->set_route_hash(h[7]);
  e->set_blocks_only(true);
  // A router per block (its recent-work tie-break starts at zero), told d1's
  // holding.
  std::unique_ptr<PrefillRouter> router;
  auto make = [&] {
    router = std::make_unique<PrefillRouter>(RoutingPolicy::kLeastLoad,
                                             CacheAwareOptions{}, &clock_);
    router->OnRegister(d1);
    return std::make_unique<Placement>(
        PlacementDeps{&registry_, &ledger_, &metrics_, &clock_, router.get()}, options_,
        PlacementRequest{.request_id = "req-held",
                         .prompt_tokens = 640,
                         .deadline = clock_.Now() + absl::Seconds(60),
                         .started = clock_.Now(),
                         .prefix_hashes = h});
  };
  // Ends a placement that is prefilling on `d` (the ledger forgets it).
  auto end = [&](Placement& p, const std::string& d) {
    ASSERT_EQ(Str(p.Cancel()), "cancel");
    ASSERT_EQ(Str(p.OnPrefilled(absl::CancelledError())),
              "release " + d + ", finish CANCELLED");
  };
  // Both prefill workers write after held rows: shared, reserved on the holder.
  {
    auto p = make();
    Placement::Actions a = p->Start();
    ASSERT_EQ(Str(a), "reserve d1");
    EXPECT_TRUE(a[0].share_held_prefix);
    EXPECT_EQ(Str(p->OnReserved(absl::OkStatus(), 512)), "prefill p0");
    end(*p, "d1");
  }
  // Neither does (older workers): nothing shared, and the holding weighs
  // nothing (room and id: d0).
  AddWorker("p0", tandem::v1::WORKER_ROLE_PREFILL, {}, false);
  AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL, {}, false);
  {
    auto p = make();
    Placement::Actions a = p->Start();
    ASSERT_EQ(Str(a), "reserve d0");
    EXPECT_FALSE(a[0].share_held_prefix);
    ASSERT_EQ(Str(p->OnReserved(absl::OkStatus(), 0)), "prefill p0");
    end(*p, "d0");
  }
  // Mid-upgrade: p1 writes after held rows, p0 does not. A reservation that
  // shares rows goes to p1 although p0 sorts first; one that shares none to
  // p0.
  AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL, {}, true);
  {
    auto p = make();
    Placement::Actions a = p->Start();
    ASSERT_EQ(Str(a), "reserve d1");
    EXPECT_TRUE(a[0].share_held_prefix);
    EXPECT_EQ(Str(p->OnReserved(absl::OkStatus(), 512)), "prefill p1");
    // p1 is lost: p0 would overwrite the shared rows, so the reservation is
    // released and made again sharing nothing, which p0 then prefills.
    ASSERT_EQ(Str(p->OnPrefilled(absl::UnavailableError("p1 died"))),
              "release d1 (await)");
    a = p->OnReleased(absl::OkStatus());
    ASSERT_EQ(Str(a), "reserve d0");
    EXPECT_FALSE(a[0].share_held_prefix);
    EXPECT_EQ(Str(p->OnReserved(absl::OkStatus(), 0)), "prefill p0");
    end(*p, "d0");
  }
  AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL, {}, true);
  {
    // d1 shared nothing after all (its blocks went meanwhile): any worker.
    auto p = make();
    ASSERT_EQ(Str(p->Start()), "reserve d1");
    EXPECT_EQ(Str(p->OnReserved(absl::OkStatus(), 0)), "prefill p0");
    end(*p, "d1");
  }
  {
    // A registration that changes under a sharing reservation (p1 restarted
    // as an older build): no writer left, so it is reserved again unshared.
    auto p = make();
    ASSERT_EQ(Str(p->Start()), "reserve d1");
    AddWorker("p1", tandem::v1::WORKER_ROLE_PREFILL, {}, false);
    ASSERT_EQ(Str(p->OnReserved(absl::OkStatus(), 512)), "release d1 (await)");
    Placement::Actions a = p->OnReleased(absl::OkStatus());
    ASSERT_EQ(Str(a), "reserve d0");
    EXPECT_FALSE(a[0].share_held_prefix);
    EXPECT_EQ(Str(p->OnReserved(absl::OkStatus(), 0)), "prefill p0");
    end(*p, "d0");
  }
  EXPECT_EQ(Retries("held_prefix_writer"), 1);
  EXPECT_EQ(Retries("prefill_unavailable"), 1);
}

// An image prompt's decode-side hit needs a decode worker that reads the
// images' spans (reserves_with_images): its cache keys carry their hashes. An
// older one's keys would not, so its holding weighs nothing, nothing is
// shared with it, and it gets neither the ids nor the spans.
TEST_F(PlacementTest, ImagePromptsShareOnlyWithDecodeWorkersThatReadTheirSpans) {
  std::vector<int32_t> prompt(640);
  for (int i = 0; i < 640; ++i) prompt[i] = i * 17 % 4093;
  tandem::v1::GenerateRequest req;
  for (int32_t t : prompt) req.mutable_prompt_token_ids()->add_ids(t);
  tandem::v1::ImageInput* im = req.add_images();
  im->set_placeholder_start(100);
  im->set_num_tokens(20);
  im->set_content_hash(0xa11ce);
  const std::vector<uint64_t> h = RouterBlockHashes(req);
  for (bool reads_spans : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "reserves_with_images " << reads_spans);
    // d1 reported the prompt's first 512 tokens (with the image) held.
    tandem::v1::RegisterRequest d1 = Worker("d1", tandem::v1::WORKER_ROLE_DECODE);
    d1.set_reports_prefix_cache(true);
    d1.set_prefix_epoch(1);
    d1.set_reserves_with_images(reads_spans);
    tandem::v1::PrefixCacheEvent* e = d1.add_prefix_snapshot();
    e->set_kind(tandem::v1::PrefixCacheEvent::KIND_STORED);
    e->set_tokens(512);
    e->set_route_hash(h[7]);
    e->set_blocks_only(true);
    ASSERT_TRUE(registry_.Register(d1).ok());
    PrefillRouter router(RoutingPolicy::kLeastLoad, CacheAwareOptions{}, &clock_);
    router.OnRegister(d1);
    Placement p(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_, &router},
                options_,
                PlacementRequest{.request_id = "req-image-held",
                                 .prompt_tokens = 640,
                                 .deadline = clock_.Now() + absl::Seconds(60),
                                 .started = clock_.Now(),
                                 .prefix_hashes = h,
                                 .has_images = true});
    Placement::Actions a = p.Start();
    // d0 (an older decode worker here) sorts first with the same room.
    ASSERT_EQ(Str(a), reads_spans ? "reserve d1" : "reserve d0");
    EXPECT_EQ(a[0].share_held_prefix, reads_spans);
    EXPECT_EQ(a[0].send_images, reads_spans);
    ASSERT_EQ(Str(p.OnReserved(absl::OkStatus(), reads_spans ? 512 : 0)), "prefill p0");
    ASSERT_EQ(Str(p.Cancel()), "cancel");
    ASSERT_EQ(
        Str(p.OnPrefilled(absl::CancelledError())),
        absl::StrCat("release ", reads_spans ? "d1" : "d0", ", finish CANCELLED"));
  }
}

namespace images {

PlacementRequest ImageRequest(FakeClock& clock) {
  return PlacementRequest{.request_id = "req-1",
                          .prompt_tokens = 10,
                          .deadline = clock.Now() + absl::Seconds(60),
                          .started = clock.Now(),
                          .has_images = true};
}

}  // namespace images

TEST_F(PlacementTest, ImagePromptsAreDisaggregatedBelowTheThreshold) {
  options_.colocate_below_tokens = 1000;  // a 10-token text prompt is colocated
  ASSERT_EQ(Str(Make()->Start()), "colocate d0");
  Placement p(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
              images::ImageRequest(clock_));
  ASSERT_EQ(Str(p.Start()), "reserve d0");
  ASSERT_EQ(Str(p.OnReserved(absl::OkStatus())), "prefill p0");
  ASSERT_EQ(Str(p.OnPrefilled(absl::OkStatus())), "decode d0");
  EXPECT_EQ(Str(p.OnStreamDone(absl::OkStatus())), "finish OK");
}

TEST_F(PlacementTest, ImagePromptsWithoutAPrefillWorkerAreUnavailableNotColocated) {
  registry_.Remove("p1");
  Placement p(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
              images::ImageRequest(clock_));
  ASSERT_EQ(Str(p.Start()), "reserve d0");
  ASSERT_EQ(Str(p.OnReserved(absl::OkStatus())), "prefill p0");
  ASSERT_EQ(Str(p.OnPrefilled(absl::UnavailableError("gone"))), "release d0 (await)");
  ASSERT_EQ(Str(p.OnReleased(absl::OkStatus())), "reserve d0");
  // No prefill worker left: released, then refused instead of colocated.
  ASSERT_EQ(Str(p.OnReserved(absl::OkStatus())), "release d0 (await)");
  EXPECT_EQ(Str(p.OnReleased(absl::OkStatus())), "finish UNAVAILABLE");
  EXPECT_EQ(Paths("colocated"), 0);
  EXPECT_TRUE(LedgerEmpty());

  registry_.Remove("p0");
  Placement q(PlacementDeps{&registry_, &ledger_, &metrics_, &clock_}, options_,
              images::ImageRequest(clock_));
  EXPECT_EQ(Str(q.Start()), "finish UNAVAILABLE");
}

}  // namespace
}  // namespace tandem::router
