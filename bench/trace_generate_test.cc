#include "bench/trace_generate.h"

#include <map>
#include <set>
#include <string>

#include "bench/trace_format.h"
#include "bench/trace_ideal.h"
#include "bench/trace_tokens.h"
#include "gtest/gtest.h"

namespace tandem::bench {
namespace {

std::vector<TraceRecord> Gen(const std::string& kind, uint64_t seed = 1, int n = 40) {
  GenerateOptions o;
  o.kind = kind;
  o.seed = seed;
  o.requests = n;
  auto t = GenerateTrace(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : std::vector<TraceRecord>{};
}

std::string Text(const std::vector<TraceRecord>& t) {
  std::string s;
  for (const TraceRecord& r : t) s += FormatTraceLine(r) + "\n";
  return s;
}

TEST(TraceGenerateTest, EveryKindIsAValidTraceOfTheSizeAsked) {
  for (const char* kind : {"multiturn", "system_prompt", "agent"}) {
    SCOPED_TRACE(kind);
    const auto t = Gen(kind, 3, 37);
    ASSERT_EQ(t.size(), 37u);
    // The parser accepts what the generator writes (ids per block, ordered times).
    auto parsed = ParseTrace(Text(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->size(), 37u);
    EXPECT_EQ(t.front().timestamp_ms, 0);
  }
}

TEST(TraceGenerateTest, DeterministicInTheSeed) {
  for (const char* kind : {"multiturn", "system_prompt", "agent"}) {
    EXPECT_EQ(Text(Gen(kind, 5)), Text(Gen(kind, 5))) << kind;
    EXPECT_NE(Text(Gen(kind, 5)), Text(Gen(kind, 6))) << kind;
  }
}

TEST(TraceGenerateTest, RejectsBadOptions) {
  GenerateOptions o;
  o.kind = "chat";
  EXPECT_FALSE(GenerateTrace(o).ok());
  o.kind = "multiturn";
  o.requests = 0;
  EXPECT_FALSE(GenerateTrace(o).ok());
  o.requests = 4;
  o.sessions_per_s = 0;
  EXPECT_FALSE(GenerateTrace(o).ok());
}

// Each later turn extends the previous turn of its session: its ids start with all
// of that turn's full blocks, and it is longer.
void ExpectTurnsExtend(const std::vector<TraceRecord>& t, size_t shared_blocks) {
  std::map<int64_t, const TraceRecord*> last;  // first own id -> latest turn
  int later_turns = 0;
  for (const TraceRecord& r : t) {
    ASSERT_GT(r.hash_ids.size(), shared_blocks);
    const int64_t session = r.hash_ids[shared_blocks];
    auto it = last.find(session);
    if (it != last.end()) {
      const TraceRecord& p = *it->second;
      const size_t full = p.input_length / kTraceBlockTokens;
      ASSERT_GE(r.hash_ids.size(), full);
      EXPECT_TRUE(std::equal(p.hash_ids.begin(), p.hash_ids.begin() + full,
                             r.hash_ids.begin()));
      EXPECT_GT(r.input_length, p.input_length);
      EXPECT_GT(r.timestamp_ms, p.timestamp_ms);
      ++later_turns;
    }
    last[session] = &r;
  }
  EXPECT_GT(later_turns, static_cast<int>(t.size()) / 3);
}

TEST(TraceGenerateTest, MultiturnTurnsExtendThePreviousTurn) {
  ExpectTurnsExtend(Gen("multiturn"), 0);
}

TEST(TraceGenerateTest, AgentsShareToolsAndGrowTheirHistory) {
  const auto t = Gen("agent");
  for (const TraceRecord& r : t) {
    for (int i = 0; i < 8; ++i) EXPECT_EQ(r.hash_ids[i], t[0].hash_ids[i]);
  }
  ExpectTurnsExtend(t, 8);
}

TEST(TraceGenerateTest, SystemPromptIdealHitRateIsKnown) {
  const auto t = Gen("system_prompt", 2, 30);
  std::set<int64_t> own;
  for (const TraceRecord& r : t) {
    ASSERT_EQ(r.hash_ids.size(), 9u);  // 8 system blocks + part of one
    EXPECT_GT(r.input_length, 8 * 512);
    EXPECT_LT(r.input_length, 9 * 512);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(r.hash_ids[i], t[0].hash_ids[i]);
    EXPECT_TRUE(own.insert(r.hash_ids[8]).second);  // questions are all different
  }
  // Every request after the first reuses exactly the 512-token (scaled) system prompt.
  auto s = MakeTraceScale(0.125, 0, 100, 60000);
  ASSERT_TRUE(s.ok());
  const IdealHits h = ComputeIdealHits(t, *s);
  EXPECT_EQ(h.hit_tokens, 29 * 512);
  // Two prompts: each request's first 8 ids are one of two sets.
  GenerateOptions o;
  o.kind = "system_prompt";
  o.system_prompts = 2;
  o.requests = 30;
  auto two = GenerateTrace(o);
  ASSERT_TRUE(two.ok());
  std::set<int64_t> firsts;
  for (const TraceRecord& r : *two) firsts.insert(r.hash_ids[0]);
  EXPECT_EQ(firsts.size(), 2u);
}

}  // namespace
}  // namespace tandem::bench
