// Image input in the engine (VISION.md section 3): the vision tower's rows
// replace the <|media_pad|> placeholders' embeddings in layer 0's input.
// Chunked prefill with chunk boundaries inside an image equals one chunk; the
// image's content changes the output; prefix-cache hits never cross a
// different image (and a legitimate hit before it still continues exactly).
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/time/time.h"
#include "common/route_hash.h"
#include "engine/cache/prefix_events.h"
#include "engine/media/patched_image.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/vision/vision_tower.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

media::PatchedImage RandomImage(int gh, int gw, uint32_t seed) {
  media::PatchedImage im;
  im.grid_h = gh;
  im.grid_w = gw;
  im.patch_size = 14;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  im.patches.resize(static_cast<size_t>(gh) * gw * 588);
  for (float& v : im.patches) v = u(rng);
  im.content_hash = 0x9e3779b97f4a7c15ull * (seed + 1);
  return im;
}

// The prompt: text 70 | image A (20 rows, 70..89) | text 30 | image B (8 rows,
// 120..127) | text 40: 168 tokens.
struct Prompt {
  std::vector<int32_t> tokens;
  std::vector<MediaInput> media;
};

class ImageInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ckpt_ = model::Checkpoint::Open(testing::kTinyCheckpointDir).value().release();
    tower_backend_ = MakeBackend("cpu").release();
    auto t = vision::VisionTower::Load(*ckpt_, tower_backend_);
    ASSERT_TRUE(t.ok()) << t.status();
    tower_ = t->release();
  }

  MediaInput Encode(const media::PatchedImage& im, int64_t position) {
    auto rows = tower_->Encode({&im});
    EXPECT_TRUE(rows.ok()) << rows.status();
    MediaInput m;
    m.position = position;
    m.rows = im.num_tokens();
    m.content_hash = im.content_hash;
    m.embeddings = std::make_shared<const std::vector<float>>(std::move(rows).value());
    return m;
  }

  Prompt MakeImagePrompt(const media::PatchedImage& a, const media::PatchedImage& b) {
    const int32_t pad =
        static_cast<int32_t>(TinyWeights().config.media_placeholder_token_id);
    Prompt p;
    auto text = [&](int n, uint64_t seed) {
      std::vector<int32_t> t = MakePrompt(n, seed);
      p.tokens.insert(p.tokens.end(), t.begin(), t.end());
    };
    text(70, 1);
    p.media.push_back(Encode(a, p.tokens.size()));
    p.tokens.insert(p.tokens.end(), a.num_tokens(), pad);
    text(30, 2);
    p.media.push_back(Encode(b, p.tokens.size()));
    p.tokens.insert(p.tokens.end(), b.num_tokens(), pad);
    text(40, 3);
    EXPECT_EQ(p.tokens.size(), 168u);
    EXPECT_EQ(p.media[0].position, 70);
    EXPECT_EQ(p.media[1].position, 120);
    return p;
  }

  static EngineOptions Options() {
    EngineOptions o;
    o.num_slots = 4;
    o.max_context_tokens = 1024;
    o.sampling_threads = 1;
    return o;
  }
  // Prefix caching at the KDA chunk grid (64), 8 snapshots; `generations`: a
  // finished reply is continued for the next turn.
  static EngineOptions Cached(bool generations) {
    EngineOptions o = Options();
    o.prefix_caching.enabled = true;
    o.prefix_caching.num_snapshots = 8;
    o.prefix_caching.snapshot_grid = 64;
    o.prefix_caching.snapshot_generations = generations;
    return o;
  }

  struct Run {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    int64_t cached = 0;
  };
  // One engine, the requests in turn (each to completion); greedy, 6 tokens.
  // With o.tp.tp_size > 1 the engine runs that many CPU ranks (threads).
  static std::vector<Run> RunSequentially(EngineOptions o,
                                          const std::vector<Prompt>& prompts) {
    std::unique_ptr<kernels::Backend> backend;
    if (o.tp.tp_size > 1) {
      o.tp.backend = "cpu";
      o.tp.threads_per_rank = 1;
      o.tp.timeout = absl::Seconds(30);
      o.tp_checkpoint = ckpt_;
    } else {
      backend = MakeBackend("cpu");
    }
    auto e = Engine::Create(o.tp.tp_size > 1 ? nullptr : &TinyWeights(), backend.get(),
                            nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    std::vector<Run> runs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SamplingParams p;
      p.max_tokens = 6;
      p.ignore_eos = true;
      p.logprobs = true;
      Run run;
      absl::Status s = (*e)->AddRequest(static_cast<RequestId>(i + 1),
                                        prompts[i].tokens, p, "", prompts[i].media);
      EXPECT_TRUE(s.ok()) << s;
      for (int step = 0; (*e)->HasWork() && step < 1000; ++step) {
        auto res = (*e)->Step();
        EXPECT_TRUE(res.ok()) << res.status();
        if (!res.ok()) break;
        for (const RequestOutput& out : *res) {
          run.tokens.insert(run.tokens.end(), out.new_tokens.begin(),
                            out.new_tokens.end());
          for (const auto& lp : out.logprobs) run.logprobs.push_back(lp.logprob);
          run.cached = std::max(run.cached, out.cached_prompt_tokens);
        }
      }
      runs.push_back(std::move(run));
    }
    return runs;
  }

  static double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
    }
    return d;
  }

  static model::Checkpoint* ckpt_;
  static kernels::Backend* tower_backend_;
  static vision::VisionTower* tower_;
};

model::Checkpoint* ImageInputTest::ckpt_ = nullptr;
kernels::Backend* ImageInputTest::tower_backend_ = nullptr;
vision::VisionTower* ImageInputTest::tower_ = nullptr;

TEST_F(ImageInputTest, ChunkBoundariesInsideImagesEqualOneChunk) {
  const media::PatchedImage a = RandomImage(8, 10, 1), b = RandomImage(4, 8, 2);
  const Prompt p = MakeImagePrompt(a, b);
  EngineOptions whole = Options();
  whole.max_tokens_per_step = 256;
  EngineOptions chunked = Options();
  chunked.max_tokens_per_step = 64;
  chunked.max_prefill_chunk = 25;  // boundaries at 75, 100, 125: inside A and B
  const Run one = RunSequentially(whole, {p})[0];
  const Run many = RunSequentially(chunked, {p})[0];
  ASSERT_EQ(one.tokens.size(), 6u);
  EXPECT_EQ(many.tokens, one.tokens);
  // Logprobs: chunked prefill regroups the KDA chunks and MLA tiles (fp32
  // reassociation, chunk_alignment_test): 1e-3 absolute on log-probabilities.
  EXPECT_LE(MaxDiff(many.logprobs, one.logprobs), 1e-3);

  // The image's content is what the model sees: a different B changes them.
  const Prompt p2 = MakeImagePrompt(a, RandomImage(4, 8, 3));
  const Run other = RunSequentially(whole, {p2})[0];
  EXPECT_GT(MaxDiff(other.logprobs, one.logprobs), 1e-3);
}

// Tensor parallelism: every rank writes the image rows over its all-reduced
// embeddings, so TP 2 and TP 4 give the TP 1 tokens (logprobs within the TP
// reduction order's rounding): with chunk boundaries inside both images, and
// with a prefix-cache hit of the same images (none across another image).
TEST_F(ImageInputTest, TensorParallelRanksGiveTheTp1Tokens) {
  const media::PatchedImage a = RandomImage(8, 10, 1), b = RandomImage(4, 8, 2);
  const Prompt p = MakeImagePrompt(a, b);
  const Prompt other_b = MakeImagePrompt(a, RandomImage(4, 8, 5));
  EngineOptions chunked = Options();
  chunked.max_tokens_per_step = 64;
  chunked.max_prefill_chunk = 25;  // boundaries at 75, 100, 125: inside A and B
  EngineOptions cached = Cached(/*generations=*/false);
  cached.max_tokens_per_step = 256;
  for (EngineOptions o : {chunked, cached}) {
    SCOPED_TRACE(o.prefix_caching.enabled ? "cached" : "chunked");
    const std::vector<Run> want = RunSequentially(o, {p, other_b, p});
    ASSERT_EQ(want[0].tokens.size(), 6u);
    EXPECT_NE(want[1].tokens, want[0].tokens);  // the image matters
    if (o.prefix_caching.enabled) {
      EXPECT_EQ(want[1].cached, 64);   // B differs from 120
      EXPECT_EQ(want[2].cached, 128);  // the same images
    }
    for (int tp : {2, 4}) {
      SCOPED_TRACE(::testing::Message() << "TP " << tp);
      o.tp.tp_size = tp;
      const std::vector<Run> got = RunSequentially(o, {p, other_b, p});
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
        EXPECT_EQ(got[i].cached, want[i].cached) << "request " << i;
        EXPECT_LE(MaxDiff(got[i].logprobs, want[i].logprobs), 1e-3) << "request " << i;
      }
    }
  }
}

TEST_F(ImageInputTest, PrefixCacheNeverHitsAcrossDifferentImages) {
  const media::PatchedImage a = RandomImage(8, 10, 1), b = RandomImage(4, 8, 2);
  const media::PatchedImage a2 = RandomImage(8, 10, 4), b2 = RandomImage(4, 8, 5);
  const Prompt p = MakeImagePrompt(a, b);
  const Prompt same = MakeImagePrompt(a, b);
  const Prompt other_b = MakeImagePrompt(a, b2);
  const Prompt other_a = MakeImagePrompt(a2, b);
  EngineOptions cached = Cached(/*generations=*/false);
  const std::vector<Run> runs = RunSequentially(cached, {p, same, other_b, other_a});
  EXPECT_EQ(runs[0].cached, 0);
  // Hits are at multiples of 64 (the KDA chunk) below the prompt's end.
  EXPECT_EQ(runs[1].cached, 128);  // the same images: up to the last snapshot
  EXPECT_EQ(runs[2].cached, 64);   // B differs from 120: only text before it
  EXPECT_EQ(runs[3].cached, 64);   // A differs from 70
  // And a hit continues exactly as a recompute with the cache off.
  const std::vector<Run> fresh = RunSequentially(Options(), {other_b, other_a, same});
  EXPECT_EQ(runs[2].tokens, fresh[0].tokens);
  EXPECT_EQ(runs[3].tokens, fresh[1].tokens);
  EXPECT_EQ(runs[1].tokens, fresh[2].tokens);
  EXPECT_LE(MaxDiff(runs[2].logprobs, fresh[0].logprobs), 1e-3);
}

// A finished image prompt's reply is cached for the next turn (the background
// continuation, prefix_caching.snapshot_generations): it keys its blocks with
// the images' hashes, so the next turn (the same images, the reply, more
// text) hits past the prompt, and continues as a cache-off run does.
TEST_F(ImageInputTest, TheReplyToAnImagePromptIsCachedForTheNextTurn) {
  const Prompt p = MakeImagePrompt(RandomImage(8, 10, 1), RandomImage(4, 8, 2));
  EngineOptions o = Cached(/*generations=*/true);
  o.max_tokens_per_step = 256;
  auto backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
  ASSERT_TRUE(e.ok()) << e.status();
  auto run = [&](RequestId id, const Prompt& q, int max_tokens) {
    SamplingParams sp;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    sp.logprobs = true;
    Run out;
    EXPECT_TRUE((*e)->AddRequest(id, q.tokens, sp, "", q.media).ok());
    for (int step = 0; (*e)->HasWork() && step < 2000; ++step) {
      auto res = (*e)->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) break;
      for (const RequestOutput& r : *res) {
        if (r.id != id) continue;
        out.tokens.insert(out.tokens.end(), r.new_tokens.begin(), r.new_tokens.end());
        for (const auto& lp : r.logprobs) out.logprobs.push_back(lp.logprob);
        out.cached = std::max(out.cached, r.cached_prompt_tokens);
      }
    }
    return out;
  };
  const Run first = run(1, p, 100);  // 268 tokens: the continuation runs 128..256
  ASSERT_EQ(first.tokens.size(), 100u);
  Prompt next = p;
  next.tokens.insert(next.tokens.end(), first.tokens.begin(), first.tokens.end());
  const std::vector<int32_t> more = MakePrompt(20, 9);
  next.tokens.insert(next.tokens.end(), more.begin(), more.end());
  const Run second = run(2, next, 6);
  EXPECT_EQ(second.cached, 256);  // past the prompt's own snapshot (128)
  const Run fresh = RunSequentially(Options(), {next})[0];
  EXPECT_EQ(second.tokens, fresh.tokens);
  EXPECT_LE(MaxDiff(second.logprobs, fresh.logprobs), 1e-3);
}

// On a decode worker the images come as spans without embeddings (Reserve).
// A reply is never continued past an image whose rows it could not recompute:
// an image reaching past the prompt's last chunk is not submitted at all.
// (One before it is submitted, and skipped as a text prompt's is there: a
// landed prompt leaves blocks, no KDA snapshot to continue from.)
TEST_F(ImageInputTest, ADecodeWorkerNeverContinuesOverImageRowsItCannotCompute) {
  const int32_t pad =
      static_cast<int32_t>(TinyWeights().config.media_placeholder_token_id);
  // 168 tokens, images end at 128 = the prompt's snapshot: continued.
  const Prompt early = MakeImagePrompt(RandomImage(8, 10, 1), RandomImage(4, 8, 2));
  // text 130 | image (8 rows, 130..137) | text 20: it ends past 128.
  Prompt late;
  late.tokens = MakePrompt(130, 4);
  late.media.push_back(Encode(RandomImage(4, 8, 3), 130));
  late.tokens.insert(late.tokens.end(), 8, pad);
  const std::vector<int32_t> tail = MakePrompt(20, 5);
  late.tokens.insert(late.tokens.end(), tail.begin(), tail.end());

  EngineOptions o = Cached(/*generations=*/true);
  o.max_tokens_per_step = 256;
  auto prefill_backend = MakeBackend("cpu");
  auto decode_backend = MakeBackend("cpu");
  auto prefill =
      Engine::Create(&TinyWeights(), prefill_backend.get(), nullptr, Options());
  auto decode = Engine::Create(&TinyWeights(), decode_backend.get(), nullptr, o);
  ASSERT_TRUE(prefill.ok() && decode.ok());
  SamplingParams sp;
  sp.max_tokens = 100;
  sp.ignore_eos = true;
  // Prefills `q` on the prefill engine and lands it in a reservation with the
  // images' spans on the decode engine; returns its 100 tokens.
  auto hand_off = [&](RequestId id, const Prompt& q) {
    std::vector<int32_t> tokens;
    EXPECT_TRUE((*prefill)->AddRequest(id, q.tokens, sp, "", q.media).ok());
    for (int step = 0; tokens.empty() && step < 100; ++step) {
      auto res = (*prefill)->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) return tokens;
      for (const RequestOutput& r : *res) tokens = r.new_tokens;
    }
    auto state = (*prefill)->ExportState(id);
    EXPECT_TRUE(state.ok()) << state.status();
    std::vector<MediaInput> spans = q.media;
    for (MediaInput& m : spans) m.embeddings = nullptr;
    auto loc = (*decode)->Reserve(id, static_cast<int64_t>(q.tokens.size()), q.tokens,
                                  "", /*share_held_prefix=*/false, std::move(spans));
    EXPECT_TRUE(loc.ok()) << loc.status();
    auto dst = (*decode)->executor().ExportSequence(
        loc->block_ids, loc->num_cached_tokens, static_cast<int32_t>(loc->slot));
    EXPECT_TRUE(dst.ok()) << dst.status();
    EXPECT_TRUE(CopyStateRanges(state->ranges, *dst).ok());
    auto out = (*decode)->AdmitReserved(id, *state, sp);
    EXPECT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE((*prefill)->Abort(id).ok());  // the prefill side's copy
    for (int step = 0; (*decode)->HasWork() && step < 2000; ++step) {
      auto res = (*decode)->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) break;
      for (const RequestOutput& r : *res) {
        if (r.id == id)
          tokens.insert(tokens.end(), r.new_tokens.begin(), r.new_tokens.end());
      }
    }
    return tokens;
  };
  const std::vector<int32_t> late_reply = hand_off(1, late);
  ASSERT_EQ(late_reply.size(), 100u);
  EXPECT_EQ((*decode)->prefix_caching_stats().continuations_submitted, 0);
  const std::vector<int32_t> early_reply = hand_off(2, early);
  ASSERT_EQ(early_reply.size(), 100u);
  const PrefixCachingStats st = (*decode)->prefix_caching_stats();
  EXPECT_EQ(st.continuations_submitted, 1);
  EXPECT_EQ(st.continuations_skipped, 1);
  EXPECT_EQ(st.continuations_completed, 0);
  EXPECT_EQ((*decode)->unrecomputable_drops(), 0);
  EXPECT_FALSE((*decode)->HasWork());
}

// The route hashes the engine names its usable positions with (the prefix
// events a worker reports to the router) mix each image's content hash in at
// its first placeholder, exactly as the router hashes a request with images
// (common/route_hash.h): equal images give the router's hash, another image
// another hash from the block holding it on, text before it the text's.
TEST_F(ImageInputTest, PrefixEventsCarryTheRoutersImageHashes) {
  const media::PatchedImage a = RandomImage(8, 10, 1), b = RandomImage(4, 8, 2);
  const Prompt p = MakeImagePrompt(a, b);
  const Prompt other_b = MakeImagePrompt(a, RandomImage(4, 8, 5));
  auto route_media = [](const Prompt& q) {
    std::vector<RouteMedia> m;
    for (const MediaInput& in : q.media) m.push_back({in.position, in.content_hash});
    return m;
  };
  // The two functions agree at the route grid (64-token blocks).
  std::vector<MediaHash> mh;
  for (const MediaInput& in : p.media) mh.push_back({in.position, in.content_hash});
  EXPECT_EQ(ChainedBlockHashes(p.tokens, 64, "tenant", mh),
            RouteBlockHashes(p.tokens, "tenant", route_media(p)));

  EngineOptions o = Cached(/*generations=*/false);
  auto backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
  ASSERT_TRUE(e.ok()) << e.status();
  auto run = [&](RequestId id, const Prompt& q) {
    SamplingParams sp;
    sp.max_tokens = 2;
    sp.ignore_eos = true;
    ASSERT_TRUE((*e)->AddRequest(id, q.tokens, sp, "tenant", q.media).ok());
    for (int step = 0; (*e)->HasWork() && step < 1000; ++step) {
      ASSERT_TRUE((*e)->Step().ok());
    }
  };
  auto stored = [&]() {
    std::map<int64_t, uint64_t> out;
    for (const PrefixEvent& ev : (*e)->TakePrefixEvents()) {
      if (ev.kind == PrefixEvent::Kind::kStored) out[ev.tokens] = ev.route_hash;
    }
    return out;
  };
  run(1, p);
  const std::map<int64_t, uint64_t> first = stored();
  ASSERT_EQ(first.size(), 2u);  // 64 (the grid) and 128 (the last full chunk)
  for (const auto& [tokens, hash] : first) {
    EXPECT_EQ(hash, RoutePrefixHash(p.tokens, tokens, "tenant", route_media(p)))
        << tokens;
  }
  // 64 lies before image A (70): the text's hash; 128 holds A: not the text's.
  EXPECT_EQ(first.at(64), RoutePrefixHash(p.tokens, 64, "tenant"));
  EXPECT_NE(first.at(128), RoutePrefixHash(p.tokens, 128, "tenant"));
  // Another B (120, block 1 of the route grid): a new position at 128 with
  // the router's hash of that prompt, not the first prompt's.
  run(2, other_b);
  const std::map<int64_t, uint64_t> second = stored();
  ASSERT_EQ(second.count(128), 1u);
  EXPECT_EQ(second.at(128),
            RoutePrefixHash(other_b.tokens, 128, "tenant", route_media(other_b)));
  EXPECT_NE(second.at(128), first.at(128));
}

TEST_F(ImageInputTest, BadMediaIsInvalidArgument) {
  const Prompt p = MakeImagePrompt(RandomImage(8, 10, 1), RandomImage(4, 8, 2));
  auto backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), backend.get(), nullptr, Options());
  ASSERT_TRUE(e.ok());
  SamplingParams sp;
  sp.max_tokens = 2;
  auto expect_bad = [&](std::vector<MediaInput> media, RequestId id) {
    absl::Status s = (*e)->AddRequest(id, p.tokens, sp, "", std::move(media));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  };
  std::vector<MediaInput> shifted = p.media;
  shifted[0].position -= 1;  // its first row is a text token
  expect_bad(shifted, 1);
  std::vector<MediaInput> swapped = {p.media[1], p.media[0]};  // not ascending
  expect_bad(swapped, 2);
  std::vector<MediaInput> short_rows = p.media;
  short_rows[1].embeddings = std::make_shared<const std::vector<float>>(10, 0.0f);
  expect_bad(short_rows, 3);
  EXPECT_TRUE((*e)->AddRequest(4, p.tokens, sp, "", p.media).ok());
}

}  // namespace
}  // namespace tandem::engine
