// Prefill split at multiples of the KDA chunk (64 tokens) computes bit-identical
// state and logits to a one-shot prefill: the chunked KDA form then sees the same
// chunks, and every other op is per row (batch-invariant backends). Splits at
// other positions agree only within rounding (model_runner_test covers that).
#include <cstring>
#include <vector>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::BlockRange;
using testing::Feed;
using testing::MakeBackend;
using testing::MakeCache;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeights;

struct Result {
  std::vector<float> logits;   // the last token's row
  std::vector<uint8_t> state;  // every layer's exported state
};

Result Prefill(const std::vector<int32_t>& prompt, const std::vector<int64_t>& chunks) {
  auto backend = MakeBackend("cpu");
  auto cache = MakeCache(TinyWeights(), 32, 16, 1);
  ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
  TestSequence s{BlockRange(0, 32), 0, 0};
  Result r;
  size_t at = 0;
  for (int64_t c : chunks) {
    EXPECT_TRUE(
        Feed(&runner, &s, absl::MakeConstSpan(prompt).subspan(at, c), false, &r.logits)
            .ok());
    at += c;
  }
  EXPECT_EQ(at, prompt.size());
  auto ranges = cache->ExportSequence(s.blocks, s.pos, s.slot);
  EXPECT_TRUE(ranges.ok());
  for (const StateRange& sr : *ranges)
    r.state.insert(r.state.end(), sr.data, sr.data + sr.bytes);
  return r;
}

TEST(ChunkAlignmentTest, AlignedSplitsAreBitIdentical) {
  const std::vector<int32_t> prompt = MakePrompt(200, 5);
  const Result one = Prefill(prompt, {200});
  for (const std::vector<int64_t>& split :
       std::vector<std::vector<int64_t>>{{64, 136}, {128, 72}, {64, 64, 64, 8}}) {
    const Result r = Prefill(prompt, split);
    EXPECT_EQ(0, std::memcmp(one.logits.data(), r.logits.data(),
                             one.logits.size() * sizeof(float)));
    EXPECT_TRUE(one.state == r.state);
  }
  const Result odd = Prefill(prompt, {16, 184});
  EXPECT_NE(0, std::memcmp(one.logits.data(), odd.logits.data(),
                           one.logits.size() * sizeof(float)));
}

}  // namespace
}  // namespace tandem::engine
