// Image prompts on a decode worker's engine (issue 17, decode-side hits; the
// decode worker has no vision tower). A reservation names the prompt's images
// as spans (position, rows, content hash; no embeddings):
//   - the spans' hashes enter the cache keys as on the prefill worker, so a
//     reservation of the same prompt with the same image shares the landed
//     rows, one with another image (or none) only the blocks before it, and
//     the router's announced route hashes match only the same image;
//   - bad spans are InvalidArgument and reserve nothing;
//   - a request whose image rows this engine cannot recompute is preempted
//     only when no other running one can be (a text one gives way instead);
//     preempted, it ends with an error (never recomputed with the
//     placeholder's embedding in place of the image's); every block and slot
//     is free at the end.
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "common/route_hash.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

constexpr uint64_t kImageA = 0xa11ce;
constexpr uint64_t kImageB = 0xb0b;

// A 220-token prompt with one image's placeholders at [70, 100).
std::vector<int32_t> ImagePrompt() {
  std::vector<int32_t> p = MakePrompt(220, 77);
  const int32_t pad =
      static_cast<int32_t>(TinyWeights().config.media_placeholder_token_id);
  for (int i = 70; i < 100; ++i) p[i] = pad;
  return p;
}

std::vector<MediaInput> Image(uint64_t hash, int64_t position = 70, int64_t rows = 30) {
  return {MediaInput{.position = position, .rows = rows, .content_hash = hash}};
}

EngineOptions Cached() {
  EngineOptions o;
  o.num_slots = 4;
  o.num_blocks = 64;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 1024;
  o.sampling_threads = 1;
  o.prefix_caching.enabled = true;
  o.prefix_caching.snapshot_generations = false;
  o.prefix_caching.announce_blocks = true;  // decode_main's
  return o;
}

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// The landed state of a reservation: its prompt and first token (the rows are
// whatever the blocks hold; these tests read where they go, not their values).
ExportedState Landed(const std::vector<int32_t>& prompt, int32_t first = 5) {
  ExportedState s;
  s.prompt = prompt;
  s.generated = {first};
  s.num_cached_tokens = static_cast<int64_t>(prompt.size());
  return s;
}

// An engine on the tiny model's CPU backend (null when it cannot be made).
struct Rig {
  explicit Rig(const EngineOptions& o) : backend(MakeBackend("cpu")) {
    auto made = Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) engine = *std::move(made);
  }
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

TEST(ImageReserveEngineTest, AReservationSharesOnlyWithTheSameImages) {
  Rig rig(Cached());
  ASSERT_NE(rig.engine, nullptr);
  Engine& e = *rig.engine;
  const std::vector<int32_t> prompt = ImagePrompt();
  const int64_t n = static_cast<int64_t>(prompt.size());
  auto held = [&](RequestId id, std::vector<MediaInput> media) {
    auto loc =
        e.Reserve(id, n, prompt, "", /*share_held_prefix=*/true, std::move(media));
    EXPECT_TRUE(loc.ok()) << loc.status();
    const int64_t h = loc.ok() ? loc->held_prefix_tokens : -1;
    EXPECT_TRUE(e.Abort(id).ok());
    return h;
  };
  // The first lands with image A and is cached at admission.
  auto loc = e.Reserve(1, n, prompt, "", true, Image(kImageA));
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->held_prefix_tokens, 0);
  auto out = e.AdmitReserved(1, Landed(prompt), Greedy(2));
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(e.Abort(1).ok());  // its blocks stay cached
  // Same image: every full block of the prompt but the one with its last row
  // (Reserve shares the blocks of positions 0 .. n - 2 it holds: 13 here).
  EXPECT_EQ(held(2, Image(kImageA)), 208);
  // Another image, or the placeholders as text: only the blocks before the
  // image's first row (70 → 4 blocks of 16).
  EXPECT_EQ(held(3, Image(kImageB)), 64);
  EXPECT_EQ(held(4, {}), 64);
  // The image one row later is another prompt too.
  EXPECT_EQ(held(5, Image(kImageA, 71, 29)), 64);
  // What the router matches (the blocks-only announcements, route hashes of
  // 64-token blocks with the image mixed in at its first row) agrees.
  std::map<uint64_t, int64_t> announced;
  for (const PrefixEvent& ev : e.TakePrefixEvents()) {
    if (!ev.blocks_only) continue;
    if (ev.kind == PrefixEvent::Kind::kStored) announced[ev.route_hash] = ev.tokens;
    if (ev.kind == PrefixEvent::Kind::kRemoved) announced.erase(ev.route_hash);
  }
  auto match = [&](const std::vector<RouteMedia>& media) {
    const std::vector<uint64_t> h = RouteBlockHashes(prompt, "", media);
    for (int64_t b = static_cast<int64_t>(h.size()); b >= 1; --b) {
      auto it = announced.find(h[b - 1]);
      if (it != announced.end() && it->second == b * 64) return b * 64;
    }
    return int64_t{0};
  };
  // Only the deepest 64-multiple (and branch points, none here) is announced:
  // a prompt that differs at the image finds nothing, never more than Reserve
  // shares it.
  EXPECT_EQ(match({{.position = 70, .hash = kImageA}}), 192);
  EXPECT_EQ(match({{.position = 70, .hash = kImageB}}), 0);
  EXPECT_EQ(match({}), 0);
  EXPECT_EQ(e.num_free_slots(), 4);
}

TEST(ImageReserveEngineTest, BadSpansAreInvalidArgumentAndReserveNothing) {
  Rig rig(Cached());
  ASSERT_NE(rig.engine, nullptr);
  Engine& e = *rig.engine;
  const std::vector<int32_t> prompt = ImagePrompt();
  const int64_t n = static_cast<int64_t>(prompt.size());
  const int32_t free_blocks = e.num_free_blocks();
  struct Case {
    const char* what;
    std::vector<MediaInput> media;
    bool with_prompt;
  };
  const std::vector<Case> cases = {
      {"no rows", Image(kImageA, 70, 0), true},
      {"past the prompt", Image(kImageA, 200, 30), false},
      {"over text, not placeholders", Image(kImageA, 60, 30), true},
      {"overlapping",
       {MediaInput{.position = 70, .rows = 20, .content_hash = kImageA},
        MediaInput{.position = 80, .rows = 20, .content_hash = kImageB}},
       true},
      {"descending",
       {MediaInput{.position = 90, .rows = 10, .content_hash = kImageA},
        MediaInput{.position = 70, .rows = 10, .content_hash = kImageB}},
       true},
  };
  RequestId id = 10;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto loc = e.Reserve(id++, n, c.with_prompt ? prompt : std::vector<int32_t>{}, "",
                         true, c.media);
    EXPECT_EQ(loc.status().code(), absl::StatusCode::kInvalidArgument) << loc.status();
    EXPECT_EQ(e.num_free_blocks(), free_blocks);
    EXPECT_EQ(e.scheduler().num_reserved(), 0);
  }
  // Spans without the prompt's ids are checked against the prompt that lands.
  auto loc = e.Reserve(20, n, {}, "", false, Image(kImageA, 60, 30));
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(e.AdmitReserved(20, Landed(prompt), Greedy(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(e.Abort(20).ok());
  EXPECT_EQ(e.num_free_blocks(), free_blocks);
}

struct PreemptionRun {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, FinishReason> finish;
  int64_t preemptions = 0;
  int64_t drops = 0;
};

// Request 1 (a text prompt added here, or an image prompt reserved and
// landed) decodes beside request 2, reserved after it (so the newest), with or
// without an image, until the 24 blocks run out and one of them is preempted.
PreemptionRun RunUntilPreempted(bool first_image, bool second_image) {
  PreemptionRun run;
  EngineOptions o = Cached();
  o.num_blocks = 24;
  Rig rig(o);
  if (rig.engine == nullptr) return run;
  Engine& e = *rig.engine;
  const int32_t blocks = e.num_free_blocks();
  auto reserve = [&](RequestId id, int64_t n, bool image, int max_tokens) {
    std::vector<int32_t> prompt = ImagePrompt();
    prompt.resize(n);
    auto loc = e.Reserve(id, n, prompt, "", false,
                         image ? Image(kImageA) : std::vector<MediaInput>{});
    EXPECT_TRUE(loc.ok()) << loc.status();
    auto admitted = e.AdmitReserved(id, Landed(prompt), Greedy(max_tokens));
    EXPECT_TRUE(admitted.ok()) << admitted.status();
  };
  if (first_image) {
    reserve(1, 100, true, 120);
  } else {
    EXPECT_TRUE(e.AddRequest(1, MakePrompt(100, 5), Greedy(120)).ok());
  }
  // Every step's tokens (a reserved request's landed one is not counted).
  auto step = [&] {
    auto res = e.Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return false;
    EXPECT_TRUE(e.scheduler().CheckInvariants().ok())
        << e.scheduler().CheckInvariants();
    for (const RequestOutput& r : *res) {
      auto& v = run.tokens[r.id];
      v.insert(v.end(), r.new_tokens.begin(), r.new_tokens.end());
      if (r.finished) run.finish[r.id] = r.finish_reason;
    }
    return true;
  };
  // Its prefill (if any), then its first decode step.
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(step());
  reserve(2, 150, second_image, 100);
  for (int i = 0; e.HasWork() && i < 3000; ++i) {
    if (!step()) return run;
  }
  EXPECT_FALSE(e.HasWork());
  run.preemptions = e.scheduler().num_preemptions();
  run.drops = e.unrecomputable_drops();
  EXPECT_EQ(e.num_free_blocks(), blocks);
  EXPECT_EQ(e.num_free_slots(), o.num_slots);
  return run;
}

TEST(ImageReserveEngineTest, ARequestThatCannotBeRecomputedIsPreemptedLast) {
  // Two text prompts: the newest (2) is preempted, recomputed, and finishes
  // (1 token landed + 99 here).
  const PreemptionRun text = RunUntilPreempted(false, false);
  ASSERT_GE(text.preemptions, 1);
  EXPECT_EQ(text.drops, 0);
  EXPECT_EQ(text.finish.at(2), FinishReason::kLength);
  EXPECT_EQ(text.tokens.at(2).size(), 99u);
  EXPECT_EQ(text.finish.at(1), FinishReason::kLength);
  EXPECT_EQ(text.tokens.at(1).size(), 120u);
  // The newest is an image prompt, which this engine cannot recompute: the
  // older text one gives way instead, and both finish.
  const PreemptionRun mixed = RunUntilPreempted(false, true);
  ASSERT_GE(mixed.preemptions, 1);
  EXPECT_EQ(mixed.drops, 0);
  EXPECT_EQ(mixed.finish.at(2), FinishReason::kLength);
  EXPECT_EQ(mixed.tokens.at(2).size(), 99u);
  EXPECT_EQ(mixed.finish.at(1), FinishReason::kLength);
  EXPECT_EQ(mixed.tokens.at(1).size(), 120u);
}

TEST(ImageReserveEngineTest, APreemptedImageRequestEndsWithAnErrorNotWrongRows) {
  // Both are image prompts: the newest is preempted, and with no prefix hit
  // past its image it ends with an error rather than be recomputed with the
  // placeholder's embedding where the image's rows were; the other finishes
  // (1 landed + 119).
  const PreemptionRun image = RunUntilPreempted(true, true);
  ASSERT_GE(image.preemptions, 1);
  EXPECT_EQ(image.drops, 1);
  EXPECT_EQ(image.finish.at(2), FinishReason::kError);
  EXPECT_LT(image.tokens.at(2).size(), 99u);
  EXPECT_EQ(image.finish.at(1), FinishReason::kLength);
  EXPECT_EQ(image.tokens.at(1).size(), 119u);
}

}  // namespace
}  // namespace tandem::engine
