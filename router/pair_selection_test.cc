#include "router/pair_selection.h"

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

WorkerRecord Worker(const std::string& id, int64_t queued, int32_t running,
                    int64_t free_blocks, int32_t free_slots) {
  WorkerRecord r;
  r.registration.set_worker_id(id);
  r.load.set_queued_prefill_tokens(queued);
  r.load.set_running_requests(running);
  r.load.set_free_kv_blocks(free_blocks);
  r.load.set_total_kv_blocks(1000);
  r.load.set_free_state_slots(free_slots);
  r.load.set_total_state_slots(8);
  r.load.set_kv_block_size(16);
  return r;
}

std::string Id(const std::vector<WorkerRecord>& w, std::optional<size_t> i) {
  return i.has_value() ? w[*i].registration.worker_id() : "<none>";
}

struct PrefillCase {
  const char* name;
  std::vector<WorkerRecord> workers;
  absl::flat_hash_set<std::string> exclude;
  InFlightMap in_flight;
  std::string want;
};

TEST(PairSelectionTest, PrefillTable) {
  const std::vector<PrefillCase> cases = {
      {"empty", {}, {}, {}, "<none>"},
      {"least queued tokens",
       {Worker("a", 500, 0, 0, 0), Worker("b", 100, 9, 0, 0)},
       {},
       {},
       "b"},
      {"tie on tokens: fewest running",
       {Worker("a", 100, 3, 0, 0), Worker("b", 100, 1, 0, 0)},
       {},
       {},
       "b"},
      {"full tie: lowest id",
       {Worker("b", 0, 0, 0, 0), Worker("a", 0, 0, 0, 0)},
       {},
       {},
       "a"},
      {"excluded skipped",
       {Worker("a", 0, 0, 0, 0), Worker("b", 900, 0, 0, 0)},
       {"a"},
       {},
       "b"},
      {"all excluded", {Worker("a", 0, 0, 0, 0)}, {"a"}, {}, "<none>"},
      {"router in-flight tokens count",
       {Worker("a", 0, 0, 0, 0), Worker("b", 50, 0, 0, 0)},
       {},
       {{"a", {1, 100}}},
       "b"},
  };
  for (const PrefillCase& c : cases) {
    EXPECT_EQ(Id(c.workers, SelectPrefill(c.workers, c.exclude, c.in_flight)), c.want)
        << c.name;
  }
}

struct DecodeCase {
  const char* name;
  std::vector<WorkerRecord> workers;
  absl::flat_hash_set<std::string> exclude;
  InFlightMap in_flight;
  int64_t prompt;
  std::string want;
};

TEST(PairSelectionTest, DecodeTable) {
  const std::vector<DecodeCase> cases = {
      {"empty", {}, {}, {}, 10, "<none>"},
      {"most free cache",
       {Worker("a", 0, 0, 10, 4), Worker("b", 0, 5, 90, 4)},
       {},
       {},
       10,
       "b"},
      {"tie on cache: fewest running",
       {Worker("a", 0, 4, 50, 4), Worker("b", 0, 2, 50, 4)},
       {},
       {},
       10,
       "b"},
      {"no free slot skipped",
       {Worker("a", 0, 0, 90, 0), Worker("b", 0, 0, 10, 1)},
       {},
       {},
       10,
       "b"},
      {"prompt does not fit skipped",
       {Worker("a", 0, 0, 2, 4), Worker("b", 0, 0, 1, 4)},
       {},
       {},
       20,
       "a"},
      {"nothing fits", {Worker("a", 0, 0, 1, 4)}, {}, {}, 100, "<none>"},
      {"excluded skipped",
       {Worker("a", 0, 0, 90, 4), Worker("b", 0, 0, 10, 4)},
       {"a"},
       {},
       10,
       "b"},
      {"router reservations count",
       {Worker("a", 0, 0, 90, 4), Worker("b", 0, 0, 60, 4)},
       {},
       {{"a", {1, 800}}},
       10,
       "b"},
      {"router requests use slots",
       {Worker("a", 0, 0, 90, 1), Worker("b", 0, 0, 10, 4)},
       {},
       {{"a", {1, 0}}},
       10,
       "b"},
  };
  for (const DecodeCase& c : cases) {
    EXPECT_EQ(Id(c.workers, SelectDecode(c.workers, c.exclude, c.in_flight, c.prompt)),
              c.want)
        << c.name;
  }
}

// The prompt tokens a worker holds count as free room (a decode-side prefix
// hit): the holder wins at about equal room, not against far more.
TEST(PairSelectionTest, DecodeHeldTokensWeighAsFreeRoom) {
  struct Case {
    const char* name;
    std::vector<WorkerRecord> workers;
    absl::flat_hash_map<std::string, int64_t> held;
    int64_t prompt;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"no holdings: most free",
       {Worker("a", 0, 0, 50, 4), Worker("b", 0, 0, 60, 4)},
       {},
       400,
       "b"},
      // a: 800 + 256 held > b: 960.
      {"the holder at about equal room",
       {Worker("a", 0, 0, 50, 4), Worker("b", 0, 0, 60, 4)},
       {{"a", 256}},
       400,
       "a"},
      // a: 160 + 256 < b: 960 (a shared system prompt every worker may hold).
      {"far more room beats a holding",
       {Worker("a", 0, 0, 10, 4), Worker("b", 0, 0, 60, 4)},
       {{"a", 256}},
       400,
       "b"},
      {"held counts at most the prompt",
       {Worker("a", 0, 0, 50, 4), Worker("b", 0, 0, 60, 4)},
       {{"a", 100000}},
       100,
       "b"},
      {"a holder without a slot is skipped",
       {Worker("a", 0, 0, 90, 0), Worker("b", 0, 0, 10, 4)},
       {{"a", 512}},
       100,
       "b"},
      {"the deeper holder",
       {Worker("a", 0, 0, 50, 4), Worker("b", 0, 0, 50, 4)},
       {{"a", 64}, {"b", 128}},
       400,
       "b"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Id(c.workers, SelectDecode(c.workers, {}, {}, c.prompt, &c.held)), c.want)
        << c.name;
  }
}

}  // namespace
}  // namespace tandem::router
