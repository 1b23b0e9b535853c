// Reservations: the decode worker's table of hand-offs, one state machine per
// request id (SGLang's disaggregation/decode.py moves a request between
// prealloc, transfer, waiting and running queues; here the queues are states).
// No RPC types: the service turns RPCs into these calls and acts on what they
// return (close a stream, free memory in the engine, admit).
//
//     Add
//      │
//      ▼          Landed                      Decode
//   RESERVED ─────────────────► LANDED ───────────────────┐
//      │  │ Decode                 │                       ▼
//      │  ▼           Landed       │                   ADMITTED ──Finish──► FINISHED
//      │ LANDING ──────────────────┼────────────────────► │
//      │  │                        │                       │ Refuse (admission
//      │  │ Release, Cancel,       │ Release,              │ failed)
//      │  │ wait expiry (EXPIRED)  │ lease expiry          ▼
//      │  ▼                        │ (EXPIRED)          freed now
//      └─► QUARANTINED             ▼
//   Release,   │                freed now
//   lease      │ Tick: the quarantine is over
//   expiry     ▼
//   (EXPIRED) freed
//
// Freed before its state landed, memory is QUARANTINED: the writer may still be
// putting into it. EXPIRED is how Tick reports a lease or wait that passed.
//
//   RESERVED  memory held, no state, no Decode   ends: lease expiry, Release
//   LANDING   a Decode waits for the state       ends: wait deadline, Release, Cancel
//   LANDED    the state is in place, no Decode   ends: lease expiry, Release
//   ADMITTED  handed to the engine (verifying, admitting, decoding): the engine
//             owns the memory once admitted; Release does nothing, Cancel says
//             "cancel it in the engine"; Finish / Refuse remove it.
//   QUARANTINED  not in the id table (the id may be reserved again); its memory
//             comes back from Tick once `quarantine` has passed (0: at once).
//
// Every removal tells the caller whether to free the memory now (free_now) and
// hands back the waiting Decode (if any) for the caller to end. Time comes from
// the injected clock; expiry happens only in Tick(now) (a janitor calls it).
// Thread-safe.
#ifndef TANDEM_DECODE_RESERVATIONS_H_
#define TANDEM_DECODE_RESERVATIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace tandem::decode {

enum class ReservationState { kReserved, kLanding, kLanded, kAdmitted, kQuarantined };
const char* ReservationStateName(ReservationState s);

// Where a reservation's state goes: the engine sequence and its memory.
struct ReservationInfo {
  std::string request_id;
  int64_t engine_id = 0;  // the engine's id of the sequence holding the memory
  std::vector<int32_t> blocks;
  int32_t slot = -1;
  int32_t prompt_tokens = 0;
  // Prompt tokens the cache already held (a decode-side prefix hit): the
  // sender writes the rows from here on.
  int32_t held_tokens = 0;
  // Reserved with its prompt's ids (a decode-side prefix hit may share cached
  // blocks): their XXH3-64, which the Decode's prompt must match; 0: none.
  uint64_t prompt_fingerprint = 0;
  // The sender wrote the state straight into the engine's device memory
  // (kvtransfer::Notification::on_device): nothing to stage in. Set by Landed.
  bool landed_on_device = false;
  absl::Time lease_expiry;  // set by Add
};

// The Decode call waiting on a reservation; the service derives its own (the
// stream and the request). Owned by the table while LANDING.
class Waiter {
 public:
  virtual ~Waiter() = default;
};

// A reservation whose state landed and whose Decode arrived: now ADMITTED; the
// caller verifies and admits it, then calls Finish (or Refuse).
struct Handoff {
  ReservationInfo info;
  std::unique_ptr<Waiter> waiter;
  absl::Time decode_started;
};

// What a Release, Cancel or expiry did.
struct Removal {
  bool found = false;
  ReservationState was = ReservationState::kReserved;
  ReservationInfo info;
  // The Decode that was waiting (was == kLanding): the caller ends it.
  std::unique_ptr<Waiter> waiter;
  // The caller gives info's memory back to the engine now; false: nothing to do
  // (quarantined: Tick returns it later; admitted: the engine owns it).
  bool free_now = false;
};

struct TickResult {
  // Leases (RESERVED, LANDED) and wait deadlines (LANDING) that passed.
  std::vector<Removal> expired;
  // Quarantines that ended: free their memory now.
  std::vector<ReservationInfo> unquarantined;
};

struct ReservationsOptions {
  // How long memory freed before its state landed stays out of use.
  absl::Duration quarantine = absl::Seconds(5);
};

class Reservations {
 public:
  // `clock` is not owned and must outlive the table.
  Reservations(Clock* clock, ReservationsOptions options);

  // RESERVED, leased for `lease` from now; ALREADY_EXISTS when the id is live
  // (then nothing changes: the caller frees what it allocated). Returns the info
  // stored (its lease_expiry set).
  absl::StatusOr<ReservationInfo> Add(ReservationInfo info, absl::Duration lease);

  // A Decode arrived for `id`, waiting at most until `wait_deadline`.
  // NOT_FOUND: no such reservation; FAILED_PRECONDITION: it already has a
  // Decode. RESERVED → LANDING (the waiter is kept, nullopt); LANDED → ADMITTED
  // (the hand-off, with the waiter). `engine_id` gets the reservation's id.
  absl::StatusOr<std::optional<Handoff>> Decode(const std::string& id,
                                                std::unique_ptr<Waiter> waiter,
                                                absl::Time wait_deadline,
                                                int64_t* engine_id);

  // The transfer's notification: RESERVED → LANDED (nullopt); LANDING →
  // ADMITTED (the hand-off). NOT_FOUND for an unknown id (released, expired,
  // never reserved); FAILED_PRECONDITION when it had already landed.
  // `engine_id`, when given, must be the reservation's (its token): a
  // notification for an earlier reservation of the same id is refused
  // (FAILED_PRECONDITION) and changes nothing.
  // `on_device`: the notification's (ReservationInfo::landed_on_device).
  absl::StatusOr<std::optional<Handoff>> Landed(
      const std::string& id, std::optional<int64_t> engine_id = std::nullopt,
      bool on_device = false);

  // The router's Release: RESERVED and LANDING are quarantined (LANDING hands
  // back its waiter), LANDED is freed now, ADMITTED is left to the engine
  // (found, nothing changes).
  Removal Release(const std::string& id);

  // The Decode with the reservation `engine_id` was cancelled by its client:
  // LANDING is quarantined (the waiter handed back); ADMITTED stays (found,
  // was kAdmitted: the caller cancels it in the engine, then calls Finish).
  // Not found for another reservation of the same id or one already gone.
  Removal Cancel(const std::string& id, int64_t engine_id);

  // The admitted request ended (the engine freed its memory): removed. False
  // when `id` is not ADMITTED with `engine_id`.
  bool Finish(const std::string& id, int64_t engine_id);
  // Admission failed (corrupt state, bad request, engine refusal): removed,
  // free_now (the state had landed).
  Removal Refuse(const std::string& id, int64_t engine_id);

  // Expires leases and waits that passed by `now` and ends quarantines.
  TickResult Tick(absl::Time now);

  // Introspection.
  std::optional<ReservationState> State(const std::string& id) const;
  int64_t size() const;             // in the id table (not quarantined)
  int64_t num_admitted() const;     // of them ADMITTED
  int64_t num_quarantined() const;  // quarantine entries
  // Blocks held for hand-offs not yet in the engine (RESERVED, LANDING, LANDED,
  // quarantined).
  int64_t held_blocks() const;
  int64_t held_slots() const;

 private:
  struct Entry {
    ReservationInfo info;
    ReservationState state = ReservationState::kReserved;
    std::unique_ptr<Waiter> waiter;  // LANDING only
    absl::Time wait_deadline = absl::InfiniteFuture();
    absl::Time decode_started;
  };
  struct Quarantined {
    ReservationInfo info;
    absl::Time until;
  };

  // Takes `it` out of the table: landed state is freed now, unlanded memory is
  // quarantined (or freed now with a zero quarantine).
  Removal RemoveLocked(absl::flat_hash_map<std::string, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Handoff AdmitLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;  // not owned
  const ReservationsOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> table_ ABSL_GUARDED_BY(mu_);
  std::vector<Quarantined> quarantine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::decode

#endif  // TANDEM_DECODE_RESERVATIONS_H_
