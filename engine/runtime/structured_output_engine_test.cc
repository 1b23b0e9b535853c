// Structured outputs in the Engine (tiny checkpoint, random weights: the model
// never wants the grammar's text by itself): every output matches its
// constraint (choice, regex checked by RE2, JSON schema checked field by
// field), greedy and seeded, in batches; masks filled on the engine's mask pool
// during the forward (the default) give the tokens of masks filled at sampling
// time (structured_mask_threads 0), plain and speculative; a disaggregated run (first
// token here, the rest on another engine that replays it into its matcher) equals a
// colocated one; speculative decoding with a constraint equals plain constrained
// decoding (greedy n-gram) and stays valid with a mismatched draft model; a grammar
// that cannot finish ends by length; an engine without a tokenizer refuses a
// constraint.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "re2/re2.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* t = [] {
    auto r = tokenizer::Tokenizer::Load(testing::kTinyCheckpointDir);
    EXPECT_TRUE(r.ok()) << r.status();
    return std::move(*r).release();
  }();
  return *t;
}

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

EngineOptions Options(int threads = 2) {
  EngineOptions o;
  o.num_slots = 16;
  o.max_tokens_per_step = 256;
  o.sampling_threads = threads;
  return o;
}

Rig MakeEngine(EngineOptions o, bool tokenizer = true) {
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e =
      Engine::Create(&TinyWeights(), r.backend.get(), tokenizer ? &Tok() : nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = std::move(e).value();
  return r;
}

struct Result {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
};

std::map<RequestId, Result> RunAll(Engine* e) {
  std::map<RequestId, Result> out;
  for (int step = 0; e->HasWork() && step < 20000; ++step) {
    auto res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& o : *res) {
      Result& r = out[o.id];
      r.tokens.insert(r.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) r.finish = o.finish_reason;
    }
  }
  return out;
}

// The text of an output without its final stop token.
std::string Text(const std::vector<int32_t>& ids) {
  std::vector<int> body(ids.begin(), ids.end());
  if (!body.empty() && body.back() >= tokenizer::kNumBaseTokens) body.pop_back();
  auto t = Tok().Decode(body);
  EXPECT_TRUE(t.ok());
  return t.ok() ? *t : "";
}

StructuredOutputSpec Choice() {
  StructuredOutputSpec s;
  s.kind = StructuredOutputSpec::Kind::kChoice;
  s.choices = {"red", "green", "light blue", "yellow!"};
  return s;
}
constexpr char kRegex[] = "[A-Z][a-z]{2,5}-[0-9]{1,3}";
StructuredOutputSpec Regex() {
  StructuredOutputSpec s;
  s.kind = StructuredOutputSpec::Kind::kRegex;
  s.source = kRegex;
  return s;
}
StructuredOutputSpec Schema() {
  StructuredOutputSpec s;
  s.kind = StructuredOutputSpec::Kind::kJsonSchema;
  s.source = R"({"type":"object","properties":{"id":{"type":"integer","minimum":0},)"
             R"("tag":{"enum":["a","b","c"]},"ok":{"type":"boolean"}},)"
             R"("required":["id","tag","ok"],"additionalProperties":false})";
  return s;
}

void ExpectValid(const StructuredOutputSpec& spec, const Result& r) {
  ASSERT_EQ(r.finish, FinishReason::kStop);
  ASSERT_FALSE(r.tokens.empty());
  EXPECT_TRUE(r.tokens.back() == tokenizer::kEosId ||
              r.tokens.back() == tokenizer::kEndOfMsgId);
  const std::string text = Text(r.tokens);
  switch (spec.kind) {
    case StructuredOutputSpec::Kind::kChoice:
      EXPECT_THAT(spec.choices, ::testing::Contains(text));
      break;
    case StructuredOutputSpec::Kind::kRegex:
      EXPECT_TRUE(RE2::FullMatch(text, kRegex)) << text;
      break;
    default: {
      nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      ASSERT_TRUE(j.is_object()) << text;
      EXPECT_EQ(j.size(), 3u) << text;
      EXPECT_TRUE(j["id"].is_number_integer() && j["id"].get<int64_t>() >= 0) << text;
      EXPECT_THAT(std::vector<std::string>({"a", "b", "c"}),
                  ::testing::Contains(j["tag"].is_string() ? j["tag"].get<std::string>()
                                                           : std::string("?")))
          << text;
      EXPECT_TRUE(j["ok"].is_boolean()) << text;
    }
  }
}

SamplingParams Params(const StructuredOutputSpec& spec, int i) {
  SamplingParams p;
  p.max_tokens = 400;
  p.structured = spec;
  if (i % 2 == 1) {
    p.temperature = 1.0f;
    p.seed = 1000 + i;
  }
  return p;
}

StructuredOutputSpec SpecFor(int i) {
  switch (i % 3) {
    case 0:
      return Choice();
    case 1:
      return Regex();
    default:
      return Schema();
  }
}

TEST(StructuredOutputEngineTest, EveryOutputMatchesGreedyAndSeededInABatch) {
  Rig r = MakeEngine(Options());
  const int32_t blocks = r.engine->num_free_blocks();
  constexpr int kN = 12;
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(
        r.engine->AddRequest(i, MakePrompt(5 + i, i), Params(SpecFor(i), i)).ok());
  }
  auto out = RunAll(r.engine.get());
  ASSERT_EQ(out.size(), static_cast<size_t>(kN));
  for (int i = 0; i < kN; ++i) {
    SCOPED_TRACE(i);
    ExpectValid(SpecFor(i), out[i]);
  }
  EXPECT_GT(r.engine->structured_masks(), 0);
  EXPECT_EQ(r.engine->structured_failures(), 0);
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  // One sampling thread gives the same tokens (masks filled serially).
  Rig serial = MakeEngine(Options(1));
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(
        serial.engine->AddRequest(i, MakePrompt(5 + i, i), Params(SpecFor(i), i)).ok());
  }
  auto again = RunAll(serial.engine.get());
  for (int i = 0; i < kN; ++i) EXPECT_EQ(again[i].tokens, out[i].tokens) << i;
}

// The masks filled on the mask pool during the forward (the default) give the
// tokens of masks filled at sampling time (structured_mask_threads 0), for
// plain rows and for speculative verification rows (drafts walked during the
// forward), greedy and seeded, with unconstrained requests in the same batch.
TEST(StructuredOutputEngineTest, OverlappedMasksEqualSynchronousMasks) {
  for (const bool speculative : {false, true}) {
    SCOPED_TRACE(speculative ? "speculative" : "plain");
    auto options = [&](int mask_threads) {
      EngineOptions o = Options();
      o.structured_mask_threads = mask_threads;
      if (speculative) {
        o.speculative.method = SpeculativeMethod::kNgram;
        o.speculative.num_speculative_tokens = 3;
        o.speculative.ngram.min_n = 1;
        o.speculative.ngram.max_n = 3;
      }
      return o;
    };
    constexpr int kN = 10;
    auto params = [](int i) {
      SamplingParams p = Params(SpecFor(i), i);
      if (i % 5 == 4) p.structured.reset();         // unconstrained among them
      if (i % 2 == 0) p.repetition_penalty = 0.3f;  // loops: n-gram drafts
      return p;
    };
    auto prompt = [](int i) {
      std::vector<int32_t> p =
          Tok().Encode("{\"id\": 12, \"tag\": \"a\"} red Abc-1 ").value();
      const std::vector<int32_t> tail = MakePrompt(i % 4 + 2, 31 + i);
      p.insert(p.end(), tail.begin(), tail.end());
      return p;
    };
    Rig sync = MakeEngine(options(0));
    Rig over = MakeEngine(options(2));
    for (int i = 0; i < kN; ++i) {
      ASSERT_TRUE(sync.engine->AddRequest(i, prompt(i), params(i)).ok());
      ASSERT_TRUE(over.engine->AddRequest(i, prompt(i), params(i)).ok());
    }
    auto want = RunAll(sync.engine.get());
    auto got = RunAll(over.engine.get());
    for (int i = 0; i < kN; ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(got[i].tokens, want[i].tokens);
      EXPECT_EQ(got[i].finish, want[i].finish);
      if (params(i).structured) ExpectValid(SpecFor(i), got[i]);
    }
    EXPECT_EQ(sync.engine->structured_masks_overlapped(), 0);
    EXPECT_GT(over.engine->structured_masks_overlapped(), 0);
    // Every mask of the overlapped run was filled during a forward.
    EXPECT_EQ(over.engine->structured_masks_overlapped(),
              over.engine->structured_masks());
    EXPECT_EQ(over.engine->structured_masks(), sync.engine->structured_masks());
    EXPECT_EQ(over.engine->structured_failures(), 0);
    if (speculative) {
      EXPECT_GT(over.engine->speculative_stats().drafted_tokens, 0);
      EXPECT_EQ(over.engine->speculative_stats().accepted_tokens,
                sync.engine->speculative_stats().accepted_tokens);
    }
  }
}

TEST(StructuredOutputEngineTest, DisaggregatedEqualsColocated) {
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    const StructuredOutputSpec spec = SpecFor(i);
    const std::vector<int32_t> prompt = MakePrompt(9, 50 + i);
    Rig colo = MakeEngine(Options());
    ASSERT_TRUE(colo.engine->AddRequest(1, prompt, Params(spec, i)).ok());
    const Result want = RunAll(colo.engine.get())[1];
    ExpectValid(spec, want);

    // Prefill here: the first token only, then the state moves.
    Rig pre = MakeEngine(Options());
    SamplingParams first = Params(spec, i);
    ASSERT_TRUE(pre.engine->AddRequest(1, prompt, first).ok());
    std::vector<int32_t> got;
    while (got.empty()) {
      auto res = pre.engine->Step();
      ASSERT_TRUE(res.ok());
      for (const RequestOutput& o : *res)
        got.insert(got.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    auto state = pre.engine->ExportState(1);
    ASSERT_TRUE(state.ok()) << state.status();
    // The decode side rebuilds the matcher from the constraint and the tokens
    // generated so far.
    Rig dec = MakeEngine(Options());
    auto admitted =
        dec.engine->AddPrefilledRequestWithOutput(1, *state, Params(spec, i));
    ASSERT_TRUE(admitted.ok()) << admitted.status();
    Result rest = RunAll(dec.engine.get())[1];
    got.insert(got.end(), rest.tokens.begin(), rest.tokens.end());
    EXPECT_EQ(got, want.tokens);
  }
}

TEST(StructuredOutputEngineTest, AHandOffThatBreaksTheConstraintIsRefused) {
  Rig pre = MakeEngine(Options());
  ASSERT_TRUE(pre.engine->AddRequest(1, MakePrompt(7, 3), SamplingParams{}).ok());
  std::vector<int32_t> got;
  while (got.empty()) {
    auto res = pre.engine->Step();
    ASSERT_TRUE(res.ok());
    for (const RequestOutput& o : *res)
      got.insert(got.end(), o.new_tokens.begin(), o.new_tokens.end());
  }
  auto state = pre.engine->ExportState(1);
  ASSERT_TRUE(state.ok());
  state->generated = {Tok().Encode("zzz")->at(0)};  // no choice starts with it
  Rig dec = MakeEngine(Options());
  auto admitted =
      dec.engine->AddPrefilledRequestWithOutput(1, *state, Params(Choice(), 0));
  EXPECT_EQ(admitted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(admitted.status().message(), ::testing::HasSubstr("structured output"));
  EXPECT_FALSE(dec.engine->HasWork());
}

TEST(StructuredOutputEngineTest, SpeculativeNgramEqualsPlainAndDraftsNeverBreakIt) {
  EngineOptions spec = Options();
  spec.speculative.method = SpeculativeMethod::kNgram;
  spec.speculative.num_speculative_tokens = 3;
  spec.speculative.ngram.min_n = 1;
  spec.speculative.ngram.max_n = 3;
  constexpr int kN = 9;
  auto params = [](int i) {
    SamplingParams p = Params(SpecFor(i), 0);  // greedy
    // A repetition boost makes the model loop, so n-gram drafts are found and
    // some are accepted (others break the grammar and are cut).
    if (i % 2 == 0) p.repetition_penalty = 0.3f;
    return p;
  };
  auto prompt = [](int i) {
    std::vector<int32_t> p;
    const std::vector<int32_t> phrase =
        Tok().Encode("{\"id\": 12, \"tag\": \"a\"} red Abc-1 ").value();
    for (int k = 0; k < 3; ++k) p.insert(p.end(), phrase.begin(), phrase.end());
    const std::vector<int32_t> tail = MakePrompt(i % 4 + 1, 7 + i);
    p.insert(p.end(), tail.begin(), tail.end());
    return p;
  };
  Rig plain = MakeEngine(Options());
  Rig ngram = MakeEngine(spec);
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(plain.engine->AddRequest(i, prompt(i), params(i)).ok());
    ASSERT_TRUE(ngram.engine->AddRequest(i, prompt(i), params(i)).ok());
  }
  auto want = RunAll(plain.engine.get());
  auto got = RunAll(ngram.engine.get());
  for (int i = 0; i < kN; ++i) {
    SCOPED_TRACE(i);
    ExpectValid(SpecFor(i), got[i]);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
  }
  EXPECT_GT(ngram.engine->speculative_stats().drafted_tokens, 0);
  EXPECT_EQ(ngram.engine->num_free_slots(), spec.num_slots);
}

TEST(StructuredOutputEngineTest, AGrammarThatCannotFinishEndsByLength) {
  Rig r = MakeEngine(Options());
  StructuredOutputSpec s = Regex();
  s.source = "x{40}";
  SamplingParams p;
  p.max_tokens = 5;
  p.structured = s;
  ASSERT_TRUE(r.engine->AddRequest(1, MakePrompt(6, 1), p).ok());
  Result res = RunAll(r.engine.get())[1];
  EXPECT_EQ(res.finish, FinishReason::kLength);
  EXPECT_EQ(res.tokens.size(), 5u);
  EXPECT_TRUE(RE2::FullMatch(Text(res.tokens), "x+"));
}

// On a device backend (cuda_sim here) constrained rows are sampled on the
// device: the masks (filled on the host during the forward) go up with the
// row parameters and the kernel applies them, so the logits never come back.
// Greedy and seeded, with an unconstrained request in the batch: the same
// tokens as copying the logits back to the host sampler, every output valid,
// and the same again with the masks filled at sampling time.
TEST(StructuredOutputEngineTest, MasksAreAppliedOnTheDeviceWithTheHostsTokens) {
  auto run = [](bool device_sampling, StepTimingStats* timing, int mask_threads = 2) {
    auto be = MakeBackend("cuda_sim");
    auto weights = testing::TinyWeightsOn(*be);
    EngineOptions o = Options();
    o.num_slots = 4;
    o.device_sampling = device_sampling;
    o.structured_mask_threads = mask_threads;
    auto e = Engine::Create(weights.get(), be.get(), &Tok(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    std::map<RequestId, Result> out;
    if (!e.ok()) return out;
    for (int i = 0; i < 3; ++i) {
      SamplingParams p = Params(i == 2 ? Regex() : Choice(), i);
      EXPECT_TRUE((*e)->AddRequest(i, MakePrompt(5 + i, i), p).ok());
    }
    SamplingParams plain;
    plain.max_tokens = 4;
    plain.ignore_eos = true;
    EXPECT_TRUE((*e)->AddRequest(3, MakePrompt(7, 3), plain).ok());
    out = RunAll(e->get());
    EXPECT_GT((*e)->structured_masks(), 0);
    *timing = (*e)->step_timing();
    return out;
  };
  StepTimingStats on, off, sync;
  auto dev = run(true, &on);
  auto host = run(false, &off);
  // Masks filled at sampling time instead (on the sampling pool), not during
  // the forward: the same tokens.
  auto late = run(true, &sync, /*mask_threads=*/0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(late[i].tokens, dev[i].tokens) << i;
  EXPECT_EQ(sync.host_sampled_rows, 0);
  ASSERT_EQ(dev.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    ExpectValid(i == 2 ? Regex() : Choice(), dev[i]);
  }
  for (int i = 0; i < 4; ++i) EXPECT_EQ(dev[i].tokens, host[i].tokens) << i;
  EXPECT_GT(on.device_sampled_rows, 0);
  EXPECT_EQ(on.host_sampled_rows, 0);
  EXPECT_EQ(off.device_sampled_rows, 0);
}

TEST(StructuredOutputEngineTest, RefusedWithoutATokenizerOrWithABadGrammar) {
  Rig none = MakeEngine(Options(), /*tokenizer=*/false);
  absl::Status s = none.engine->AddRequest(1, MakePrompt(4, 1), Params(Choice(), 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(none.engine->HasWork());
  Rig r = MakeEngine(Options());
  StructuredOutputSpec bad = Regex();
  bad.source = "(unclosed";
  EXPECT_EQ(r.engine->AddRequest(1, MakePrompt(4, 1), Params(bad, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(r.engine->HasWork());
}

}  // namespace
}  // namespace tandem::engine
