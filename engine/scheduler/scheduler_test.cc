#include "engine/scheduler/scheduler.h"

#include <map>
#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

SchedulerConfig Config(int32_t blocks, int32_t block_size, int64_t budget) {
  SchedulerConfig c;
  c.num_blocks = blocks;
  c.block_size = block_size;
  c.num_slots = 8;
  c.max_tokens_per_step = budget;
  c.max_context_tokens = 4096;
  return c;
}

std::unique_ptr<Scheduler> Make(const SchedulerConfig& c) {
  auto s = Scheduler::Create(c);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

// Compact view of a plan entry: {id, start, end, samples}.
struct Entry {
  SequenceId id;
  int64_t start, end;
  bool samples;
  bool operator==(const Entry& o) const {
    return id == o.id && start == o.start && end == o.end && samples == o.samples;
  }
};
std::ostream& operator<<(std::ostream& os, const Entry& e) {
  return os << "{" << e.id << ", " << e.start << ", " << e.end << ", " << e.samples
            << "}";
}
std::vector<Entry> Entries(const StepPlan& p) {
  std::vector<Entry> out;
  for (const auto& s : p.sequences) out.push_back({s.id, s.start, s.end, s.samples});
  return out;
}

// Completes a plan: every sampling sequence gets 1 new token (all drafts
// accepted + 1 when speculative); those in `finish` end.
void Complete(Scheduler& s, const StepPlan& plan,
              const std::set<SequenceId>& finish = {}) {
  std::vector<SequenceOutcome> out;
  for (const auto& e : plan.sequences) {
    if (e.samples)
      out.push_back({e.id, e.num_draft_tokens + 1, finish.count(e.id) > 0});
  }
  auto r = s.CompleteStep(plan, out);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
}

TEST(SchedulerTest, LongPromptIsChunkedUnderTheBudget) {
  auto s = Make(Config(64, 4, 8));
  ASSERT_TRUE(s->Submit({1, 20}).ok());
  auto p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 8, false}));
  EXPECT_TRUE(p->sequences[0].resets_state);
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 8, 16, false}));
  EXPECT_FALSE(p->sequences[0].resets_state);
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 16, 20, true}));
  Complete(*s, *p);
  p = s->Schedule();  // decoding: one token at position 20
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 20, 21, true}));
  EXPECT_EQ(p->num_scheduled_tokens, 1);
}

TEST(SchedulerTest, PerSequenceChunkCap) {
  SchedulerConfig c = Config(64, 4, 16);
  c.max_prefill_chunk = 5;
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 12}).ok());
  ASSERT_TRUE(s->Submit({2, 3}).ok());
  auto p = s->Schedule();
  // Both admitted: 5 (capped) + 3.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 5, false}, Entry{2, 0, 3, true}));
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{2, 3, 4, true}, Entry{1, 5, 10, false}));
}

// Scored prompts (prompt logprobs) share max_scored_tokens_per_step between
// them, in both the running and the admission phases; others are not limited,
// and a scored request waiting for its share does not hold back the requests
// queued behind it (it keeps its place).
TEST(SchedulerTest, ScoredPromptsShareTheirPerStepTokens) {
  SchedulerConfig c = Config(256, 4, 64);
  c.max_scored_tokens_per_step = 10;
  auto s = Make(c);
  SequenceRequest a{1, 14};
  a.scored_prompt = true;
  SequenceRequest b{2, 8};
  b.scored_prompt = true;
  ASSERT_TRUE(s->Submit(a).ok());
  ASSERT_TRUE(s->Submit(b).ok());
  ASSERT_TRUE(s->Submit({3, 20}).ok());  // not scored: the budget's
  auto p = s->Schedule();
  // 1 takes all 10 scored tokens; 2 (scored) waits, 3 behind it goes.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 10, false}, Entry{3, 0, 20, true}));
  EXPECT_EQ(*s->State(2), SequenceState::kWaiting);
  Complete(*s, *p);
  p = s->Schedule();
  // 3 decodes; 1's last 4, then 2 gets the 6 left.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{3, 20, 21, true}, Entry{1, 10, 14, true},
                                       Entry{2, 0, 6, false}));
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 14, 15, true}, Entry{3, 21, 22, true},
                                       Entry{2, 6, 8, true}));
}

// Non-final chunks end at multiples of the alignment when that keeps >= 1
// token; a budget below the alignment still makes progress (unaligned), and
// the next chunk realigns.
TEST(SchedulerTest, PrefillChunksAlignToTheKdaChunk) {
  SchedulerConfig c = Config(256, 16, 100);
  c.prefill_chunk_alignment = 64;
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 300}).ok());
  std::vector<Entry> got;
  for (int i = 0; i < 6; ++i) {
    auto p = s->Schedule();
    ASSERT_TRUE(p.ok());
    for (const Entry& e : Entries(*p)) got.push_back(e);
    Complete(*s, *p);
  }
  EXPECT_THAT(got, ElementsAre(Entry{1, 0, 64, false}, Entry{1, 64, 128, false},
                               Entry{1, 128, 192, false}, Entry{1, 192, 256, false},
                               Entry{1, 256, 300, true}, Entry{1, 300, 301, true}));

  SchedulerConfig small = Config(256, 16, 40);
  small.prefill_chunk_alignment = 64;
  auto t = Make(small);
  ASSERT_TRUE(t->Submit({2, 150}).ok());
  got.clear();
  for (int i = 0; i < 5; ++i) {
    auto p = t->Schedule();
    ASSERT_TRUE(p.ok());
    for (const Entry& e : Entries(*p)) got.push_back(e);
    Complete(*t, *p);
  }
  EXPECT_THAT(got, ElementsAre(Entry{2, 0, 40, false}, Entry{2, 40, 64, false},
                               Entry{2, 64, 104, false}, Entry{2, 104, 128, false},
                               Entry{2, 128, 150, true}));

  // With other work in the step, a chunk that cannot end aligned waits: B's
  // admission would get 36 tokens (unaligned) next to A's 64, so B waits until a
  // step leaves it a multiple of 64.
  auto u = Make(c);
  ASSERT_TRUE(u->Submit({3, 300}).ok());
  ASSERT_TRUE(u->Submit({4, 100}).ok());
  got.clear();
  for (int i = 0; i < 7; ++i) {
    auto p = u->Schedule();
    ASSERT_TRUE(p.ok());
    for (const Entry& e : Entries(*p)) got.push_back(e);
    Complete(*u, *p);
  }
  EXPECT_THAT(got, ElementsAre(Entry{3, 0, 64, false}, Entry{3, 64, 128, false},
                               Entry{3, 128, 192, false}, Entry{3, 192, 256, false},
                               Entry{3, 256, 300, true}, Entry{3, 300, 301, true},
                               Entry{4, 0, 64, false}, Entry{3, 301, 302, true},
                               Entry{4, 64, 100, true}));

  SchedulerConfig bad = Config(256, 16, 40);
  bad.prefill_chunk_alignment = -1;
  EXPECT_FALSE(Scheduler::Create(bad).ok());
  // A scored cap below the alignment could never end a chunk on it.
  SchedulerConfig scored = Config(256, 16, 256);
  scored.prefill_chunk_alignment = 64;
  scored.max_scored_tokens_per_step = 63;
  EXPECT_THAT(
      Scheduler::Create(scored).status().message(),
      HasSubstr("max_scored_tokens_per_step (63) must be 0 (no limit) or at least "
                "prefill_chunk_alignment (64)"));
  scored.max_scored_tokens_per_step = 64;
  EXPECT_TRUE(Scheduler::Create(scored).ok());
}

TEST(SchedulerTest, DecodesFirstThenPrefillsThenAdmissionsFcfs) {
  auto s = Make(Config(64, 4, 6));
  ASSERT_TRUE(s->Submit({1, 2}).ok());
  auto p = s->Schedule();
  Complete(*s, *p);  // 1 is decoding now
  ASSERT_TRUE(s->Submit({2, 10}).ok());
  ASSERT_TRUE(s->Submit({3, 1}).ok());
  p = s->Schedule();
  // Decode 1 first; 2 gets the rest; 3 (short) must wait its turn.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 2, 3, true}, Entry{2, 0, 5, false}));
  EXPECT_EQ(s->num_waiting(), 1);
  Complete(*s, *p);
  p = s->Schedule();
  // 2's prefill continues before 3 is admitted, and both fit now.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 3, 4, true}, Entry{2, 5, 10, true}));
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 4, 5, true}, Entry{2, 10, 11, true},
                                       Entry{3, 0, 1, true}));
  for (int64_t i = 0; i < 3; ++i) EXPECT_LE(p->num_scheduled_tokens, 6);
}

TEST(SchedulerTest, QueueHeadIsNeverSkipped) {
  SchedulerConfig c = Config(4, 4, 64);  // 16 positions
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 10}).ok());  // takes 3 blocks
  auto p = s->Schedule();
  Complete(*s, *p);
  ASSERT_TRUE(s->Submit({2, 12}).ok());  // needs 3 blocks: only 1 free
  ASSERT_TRUE(s->Submit({3, 1}).ok());   // would fit, but waits behind 2
  p = s->Schedule();
  // 2 is admitted with a partial chunk that fits the free block...
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 10, 11, true}, Entry{2, 0, 4, false}));
  EXPECT_EQ(*s->State(3), SequenceState::kWaiting);
}

TEST(SchedulerTest, WatermarkHoldsBackAdmission) {
  SchedulerConfig c = Config(4, 4, 64);
  c.watermark_blocks = 2;
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 15}).ok());
  auto p = s->Schedule();
  // Only 4 - 2 = 2 blocks may be used for admission.
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 8, false}));
  Complete(*s, *p);
  // A running sequence's next chunk may use the reserve.
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 8, 15, true}));
}

// Pool of 4 blocks x 2 tokens. Two 3-token prompts take 2 blocks each; their
// decodes fill the partial blocks; the next decode of 1 needs a 5th block, so
// 2 (the most recently admitted) is preempted, exactly then.
TEST(SchedulerTest, PreemptsNewestExactlyWhenBlocksRunOutAndReadmitsIt) {
  auto s = Make(Config(4, 2, 64));
  ASSERT_TRUE(s->Submit({1, 3}).ok());
  ASSERT_TRUE(s->Submit({2, 3}).ok());
  auto p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 3, true}, Entry{2, 0, 3, true}));
  EXPECT_EQ(s->num_free_blocks(), 0);
  Complete(*s, *p);
  p = s->Schedule();  // positions 3: fit in the partial blocks
  EXPECT_THAT(p->preempted, IsEmpty());
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 3, 4, true}, Entry{2, 3, 4, true}));
  Complete(*s, *p);
  p = s->Schedule();  // position 4 needs a new block: none free
  EXPECT_THAT(p->preempted, ElementsAre(2));
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 4, 5, true}));
  EXPECT_EQ(*s->State(2), SequenceState::kWaiting);
  EXPECT_EQ(s->num_preemptions(), 1);
  Complete(*s, *p, /*finish=*/{1});
  // 2 comes back with prompt + its 2 generated tokens, recomputed from 0, and
  // samples when that is done.
  p = s->Schedule();
  EXPECT_THAT(p->preempted, IsEmpty());
  ASSERT_THAT(Entries(*p), ElementsAre(Entry{2, 0, 5, true}));
  EXPECT_TRUE(p->sequences[0].resets_state);
  Complete(*s, *p, {2});
  EXPECT_EQ(s->num_free_blocks(), 4);
  EXPECT_EQ(s->num_free_slots(), 8);
}

TEST(SchedulerTest, PreemptedVictimLosesItsPlanEntryAndBudget) {
  // 4 blocks x 2 tokens, budget 3, chunks of at most 2. A (older) is still
  // prefilling when B (newer) decodes; when A's next chunk finds no block, B
  // is preempted although phase 1 had already planned its decode.
  SchedulerConfig c = Config(4, 2, 3);
  c.max_prefill_chunk = 2;
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 6}).ok());
  ASSERT_TRUE(s->Submit({2, 1}).ok());
  auto p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 2, false}, Entry{2, 0, 1, true}));
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{2, 1, 2, true}, Entry{1, 2, 4, false}));
  EXPECT_THAT(p->preempted, IsEmpty());
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_THAT(p->preempted, ElementsAre(2));
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 4, 6, true}));
  EXPECT_EQ(p->num_scheduled_tokens, 2);
  EXPECT_EQ(*s->State(2), SequenceState::kWaiting);
  Complete(*s, *p);
  p = s->Schedule();  // A takes the last block; B keeps waiting
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 6, 7, true}));
  Complete(*s, *p, /*finish=*/{1});
  // B returns (prompt 1 + 2 generated = 3 tokens), recomputed in chunks.
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{2, 0, 2, false}));
}

TEST(SchedulerTest, SpeculativeDecodeReservesAndRollsBack) {
  SchedulerConfig c = Config(64, 4, 64);
  c.num_speculative_tokens = 3;
  auto s = Make(c);
  ASSERT_TRUE(s->Submit({1, 4, /*max_new_tokens=*/6}).ok());
  auto p = s->Schedule();
  Complete(*s, *p);  // 1 token generated: 5 known, 4 computed
  p = s->Schedule();
  ASSERT_EQ(p->sequences.size(), 1u);
  EXPECT_EQ(p->sequences[0].start, 4);
  EXPECT_EQ(p->sequences[0].end, 8);
  EXPECT_EQ(p->sequences[0].num_draft_tokens, 3);
  EXPECT_TRUE(p->sequences[0].samples);
  EXPECT_EQ(s->Blocks(1)->size(), 2u);  // 8 positions reserved
  // One draft accepted + correction: 2 new tokens; positions 4, 5 valid.
  auto r = s->CompleteStep(*p, {{1, 2, false}});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  EXPECT_EQ(s->Blocks(1)->size(), 2u);  // 6 positions
  EXPECT_EQ(*s->Room(1), 3);            // 10 - 7 known
  // Drafts are capped by the room left: at most 2 more after the last token.
  p = s->Schedule();
  EXPECT_EQ(p->sequences[0].num_draft_tokens, 2);
  EXPECT_EQ(p->sequences[0].start, 6);
  // Too many tokens reported is an error, nothing changes.
  EXPECT_THAT(s->CompleteStep(*p, {{1, 4, false}}).status().message(),
              HasSubstr("reported 4 new tokens; 1..3 allowed"));
  r = s->CompleteStep(*p, {{1, 3, false}});
  ASSERT_TRUE(r.ok());
  // 10 tokens = the limit: the scheduler ends it and frees it.
  EXPECT_THAT(*r, ElementsAre(1));
  EXPECT_FALSE(s->Contains(1));
  EXPECT_EQ(s->num_free_blocks(), 64);
}

TEST(SchedulerTest, AbortInEveryStateFreesEverything) {
  auto s = Make(Config(16, 4, 8));
  ASSERT_TRUE(s->Submit({1, 2}).ok());   // will decode
  ASSERT_TRUE(s->Submit({2, 20}).ok());  // will be mid-prefill
  ASSERT_TRUE(s->Submit({3, 30}).ok());  // stays waiting
  auto p = s->Schedule();
  Complete(*s, *p);
  p = s->Schedule();
  EXPECT_EQ(*s->State(3), SequenceState::kWaiting);
  // Abort while the step is in flight: its results are ignored.
  ASSERT_TRUE(s->Abort(1).ok());
  EXPECT_EQ(s->Submit({1, 2}).code(), absl::StatusCode::kFailedPrecondition);
  Complete(*s, *p);
  ASSERT_TRUE(s->Submit({1, 2}).ok());  // the id is free again
  ASSERT_TRUE(s->Abort(1).ok());
  ASSERT_TRUE(s->Abort(2).ok());  // mid-prefill
  ASSERT_TRUE(s->Abort(3).ok());  // waiting
  EXPECT_EQ(s->Abort(3).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(s->CheckInvariants().ok());
  EXPECT_EQ(s->num_free_blocks(), 16);
  EXPECT_EQ(s->num_free_slots(), 8);
  EXPECT_EQ(s->num_running() + s->num_waiting(), 0);
}

TEST(SchedulerTest, SubmissionErrorsNameTheNumbers) {
  SchedulerConfig c = Config(16, 4, 8);
  c.max_context_tokens = 1000;
  auto s = Make(c);
  EXPECT_THAT(s->Submit({1, 1001}).message(),
              HasSubstr("prompt has 1001 tokens, more than the context limit "
                        "of 1000 tokens"));
  EXPECT_THAT(s->Submit({1, 1000}).message(),
              HasSubstr("1000 tokens, which leaves no room to generate within "
                        "the context limit of 1000"));
  EXPECT_THAT(s->Submit({1, 64}).message(),
              HasSubstr("more than this worker's KV cache holds (64 tokens)"));
  EXPECT_EQ(s->Submit({1, 0}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s->Submit({1, 5}).ok());
  EXPECT_EQ(s->Submit({1, 5}).code(), absl::StatusCode::kAlreadyExists);
  // The 1M limit of the configuration itself.
  SchedulerConfig big = Config(16, 4, 8);
  big.max_context_tokens = kMaxContextTokens;
  EXPECT_TRUE(big.Validate().ok());
  big.max_context_tokens = kMaxContextTokens + 1;
  EXPECT_THAT(big.Validate().message(), HasSubstr("1048576], got 1048577"));
}

TEST(SchedulerTest, AdmitPrefilledReservesBlocksForTheTransfer) {
  auto s = Make(Config(8, 4, 8));
  ASSERT_TRUE(s->AdmitPrefilled({7, 10}, 1).ok());
  EXPECT_EQ(*s->State(7), SequenceState::kRunning);
  EXPECT_EQ(s->Blocks(7)->size(), 3u);  // 10 computed positions
  auto p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{7, 10, 11, true}));
  Complete(*s, *p);
  // Not enough blocks: refused, and nothing leaks.
  EXPECT_EQ(s->AdmitPrefilled({8, 30}, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(s->Contains(8));
  EXPECT_TRUE(s->CheckInvariants().ok());
}

// A reserved sequence holds its blocks and slot but is never scheduled and
// never preempted; admitted, it decodes at once.
TEST(SchedulerTest, ReservedIsNeitherScheduledNorPreemptedUntilAdmitted) {
  auto s = Make(Config(6, 4, 16));
  ASSERT_TRUE(s->Reserve({7, 10}, 1).ok());  // 10 positions: 3 blocks
  EXPECT_EQ(*s->State(7), SequenceState::kReserved);
  EXPECT_EQ(s->Blocks(7)->size(), 3u);
  EXPECT_EQ(s->num_reserved(), 1);
  EXPECT_EQ(s->num_running(), 0);
  EXPECT_EQ(s->num_free_blocks(), 3);
  EXPECT_EQ(s->num_free_slots(), 7);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  // A sequence that runs out of blocks preempts itself, never the reservation.
  ASSERT_TRUE(s->Submit({1, 12}).ok());  // 12 + growth > the 3 free blocks
  auto p = s->Schedule();
  ASSERT_TRUE(p.ok());
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{1, 0, 12, true}));
  Complete(*s, *p);
  p = s->Schedule();  // sequence 1 needs a 4th block: none free
  ASSERT_TRUE(p.ok());
  EXPECT_THAT(p->preempted, ElementsAre(1));
  EXPECT_THAT(Entries(*p), IsEmpty());
  Complete(*s, *p);
  EXPECT_EQ(*s->State(7), SequenceState::kReserved);
  EXPECT_EQ(s->Blocks(7)->size(), 3u);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  // Admitted: decodes from position 10, and its limit is the one given now.
  ASSERT_TRUE(s->AdmitReserved(7, 2).ok());
  EXPECT_EQ(*s->State(7), SequenceState::kRunning);
  EXPECT_EQ(s->num_reserved(), 0);
  EXPECT_EQ(*s->Room(7), 1);  // 10 + 2 allowed, 11 known
  ASSERT_TRUE(s->Abort(1).ok());
  p = s->Schedule();
  EXPECT_THAT(Entries(*p), ElementsAre(Entry{7, 10, 11, true}));
  EXPECT_FALSE(p->sequences[0].resets_state);  // the landed state stays
  auto ended = s->CompleteStep(*p, {{7, 1, false}});
  ASSERT_TRUE(ended.ok());
  EXPECT_THAT(*ended, ElementsAre(7));  // reached 10 + 2 tokens
  EXPECT_EQ(s->num_free_blocks(), 6);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(SchedulerTest, ReserveErrorsAndAbort) {
  auto s = Make(Config(6, 4, 16));
  EXPECT_EQ(s->Reserve({1, 30}, 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s->Reserve({1, 10}, 1).ok());
  EXPECT_EQ(s->Reserve({1, 4}, 1).code(), absl::StatusCode::kAlreadyExists);
  // 3 blocks left: 16 positions need 4.
  EXPECT_EQ(s->Reserve({2, 16}, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(s->Contains(2));
  EXPECT_EQ(s->AdmitReserved(2, 0).code(), absl::StatusCode::kNotFound);
  // Admitted once: not reserved any more.
  EXPECT_TRUE(s->AdmitReserved(1, 0).ok());
  EXPECT_EQ(s->AdmitReserved(1, 0).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s->Reserve({3, 4}, 1).ok());
  EXPECT_EQ(s->AdmitReserved(3, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*s->State(3), SequenceState::kReserved);
  // Abort frees a reservation at once.
  ASSERT_TRUE(s->Abort(3).ok());
  EXPECT_FALSE(s->Contains(3));
  EXPECT_EQ(s->num_reserved(), 0);
  EXPECT_EQ(s->num_free_blocks(), 3);
  EXPECT_EQ(s->num_free_slots(), 7);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(SchedulerTest, ReserveLeavesTheWatermarkFree) {
  SchedulerConfig c = Config(8, 4, 16);
  c.watermark_blocks = 2;
  auto s = Make(c);
  ASSERT_TRUE(s->Reserve({1, 16}, 1).ok());  // 4 blocks: 4 left
  EXPECT_EQ(s->Reserve({2, 12}, 1).code(),   // 3 more would leave 1 < 2
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(s->Reserve({3, 8}, 1).ok());  // 2 more leave 2
  EXPECT_EQ(s->num_free_blocks(), 2);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(SchedulerTest, ReservationsCountAgainstTheRunningCap) {
  SchedulerConfig c = Config(16, 4, 16);
  c.max_running = 2;
  auto s = Make(c);
  ASSERT_TRUE(s->Reserve({1, 4}, 1).ok());
  ASSERT_TRUE(s->AdmitPrefilled({2, 4}, 1).ok());
  EXPECT_EQ(s->Reserve({3, 4}, 1).code(), absl::StatusCode::kResourceExhausted);
  // Admission of the reserved one cannot fail on the cap.
  EXPECT_TRUE(s->AdmitReserved(1, 0).ok());
  EXPECT_EQ(s->num_running(), 2);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

// A reservation cannot be preempted: it leaves each running sequence one block
// to grow into (AdmitPrefilled, whose sequence runs at once, does not).
TEST(SchedulerTest, ReserveLeavesAGrowthBlockPerRunningSequence) {
  auto s = Make(Config(8, 4, 16));
  ASSERT_TRUE(s->AdmitPrefilled({1, 4}, 1).ok());  // running, 1 block: 7 free
  ASSERT_TRUE(s->AdmitPrefilled({2, 4}, 1).ok());  // running, 1 block: 6 free
  ASSERT_EQ(s->num_running(), 2);
  // A reservation holds the prompt's positions (prompt + 1 generated - 1).
  EXPECT_EQ(s->Reserve({3, 20}, 1).code(),  // 5 blocks would leave 1 < 2
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(s->Reserve({4, 16}, 1).ok());  // 4 blocks leave 2
  EXPECT_EQ(s->num_free_blocks(), 2);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

// Admissions from the waiting queue count reserved sequences against the cap.
TEST(SchedulerTest, ScheduleCountsReservationsAgainstTheRunningCap) {
  SchedulerConfig c = Config(16, 4, 16);
  c.max_running = 2;
  auto s = Make(c);
  ASSERT_TRUE(s->Reserve({1, 4}, 1).ok());
  ASSERT_TRUE(s->Submit({2, 3}).ok());
  ASSERT_TRUE(s->Submit({3, 3}).ok());
  auto p = s->Schedule();
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(s->num_running(), 1);  // 1 running + 1 reserved = the cap
  ASSERT_TRUE(s->AdmitReserved(1, 0).ok());
  EXPECT_LE(s->num_running(), 2);
  EXPECT_TRUE(s->CheckInvariants().ok());
}

TEST(SchedulerTest, ScheduleAndCompleteMustAlternate) {
  auto s = Make(Config(8, 4, 8));
  ASSERT_TRUE(s->Submit({1, 3}).ok());
  auto p = s->Schedule();
  EXPECT_EQ(s->Schedule().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s->CompleteStep(*p, {}).status().message(),
              HasSubstr("no outcome for sequence 1"));
  EXPECT_THAT(s->CompleteStep(*p, {{1, 1, false}, {9, 1, false}}).status().message(),
              HasSubstr("outcome for sequence 9"));
  Complete(*s, *p);
  EXPECT_EQ(s->CompleteStep(*p, {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Random workloads: budget, running cap and pool invariants hold every step;
// every sequence finishes; the pool ends empty.
TEST(SchedulerTest, RandomWorkloadsFinishAndFreeEverything) {
  int64_t total_preemptions = 0;
  int64_t dropped = 0;
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    std::mt19937 rng(seed);
    SchedulerConfig c = Config(20 + seed * 2, 4, 16 + seed * 3);
    c.num_slots = 4 + seed % 3;
    c.max_running = 5;
    c.num_speculative_tokens = seed % 3;
    c.max_prefill_chunk = seed % 2 ? 7 : 0;
    auto s = Make(c);
    std::map<SequenceId, int> target;  // tokens to generate
    std::map<SequenceId, int> generated;
    SequenceId next = 0;
    int finished = 0, steps = 0;
    while ((next < 40 || s->num_running() + s->num_waiting() > 0) && steps < 20000) {
      ++steps;
      if (next < 40 && rng() % 3 == 0) {
        const int64_t prompt = 1 + rng() % 40;
        const int64_t max_new = 1 + static_cast<int64_t>(rng() % 32);
        // Some land reserved with rows they cannot recompute (an image
        // prompt's on a decode worker): preempted last, dropped if preempted.
        bool reserved = false;
        // Every third seed, all of them (so a preemption must drop one).
        if (seed % 3 == 0 || rng() % 2 == 0) {
          SequenceRequest r{next, prompt, max_new};
          r.recompute_floor = 1 + static_cast<int64_t>(rng() % prompt);
          reserved = s->Reserve(r, 1).ok() && s->AdmitReserved(next, max_new).ok();
          if (!reserved) s->Abort(next).IgnoreError();
          if (reserved) generated[next] = 1;
        }
        if (!reserved) ASSERT_TRUE(s->Submit({next, prompt, max_new}).ok());
        target[next] = 1 + rng() % 30;
        ++next;
      }
      auto p = s->Schedule();
      ASSERT_TRUE(p.ok());
      for (SequenceId id : p->unrecomputable) {
        ASSERT_FALSE(s->Contains(id));
        ++finished;
        ++dropped;
      }
      ASSERT_LE(p->num_scheduled_tokens, c.max_tokens_per_step);
      ASSERT_LE(s->num_running(), c.max_running);
      int64_t sum = 0;
      std::set<SequenceId> ids;
      for (const auto& e : p->sequences) {
        sum += e.num_tokens();
        ASSERT_GT(e.num_tokens(), 0);
        ASSERT_TRUE(ids.insert(e.id).second);
        if (c.max_prefill_chunk > 0 && e.num_draft_tokens == 0 && !e.samples) {
          ASSERT_LE(e.num_tokens(), c.max_prefill_chunk);
        }
      }
      ASSERT_EQ(sum, p->num_scheduled_tokens);
      for (SequenceId id : p->unrecomputable) ASSERT_FALSE(ids.contains(id));
      if (rng() % 50 == 0 && !p->sequences.empty()) {
        const SequenceId victim = p->sequences[rng() % p->sequences.size()].id;
        ASSERT_TRUE(s->Abort(victim).ok());
        ++finished;
      }
      std::vector<SequenceOutcome> out;
      for (const auto& e : p->sequences) {
        if (!e.samples || !s->Contains(e.id)) continue;
        const int32_t n = 1 + rng() % (e.num_draft_tokens + 1);
        generated[e.id] += n;
        out.push_back({e.id, n, generated[e.id] >= target[e.id]});
      }
      auto r = s->CompleteStep(*p, out);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
      for (const auto& o : out) finished += o.finished;
      finished += r->size();
    }
    EXPECT_EQ(finished, 40) << "seed " << seed;
    EXPECT_GE(steps, 40);  // one submission per step at most
    total_preemptions += s->num_preemptions();
    EXPECT_EQ(s->num_free_blocks(), c.num_blocks);
    EXPECT_EQ(s->num_free_slots(), c.num_slots);
  }
  // The pools are small enough that preemption paths run, dropping some that
  // could not be recomputed.
  EXPECT_GT(total_preemptions, 0);
  EXPECT_GT(dropped, 0);
}

}  // namespace
}  // namespace tandem::engine
