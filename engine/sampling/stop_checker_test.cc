#include "engine/sampling/stop_checker.h"

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr int32_t kEos = 163585;
constexpr int32_t kText = 10;  // any ordinary token id

SamplingParams WithStops(std::vector<std::string> stops) {
  SamplingParams p;
  p.stop_strings = std::move(stops);
  return p;
}

TEST(StopCheckerTest, StopStringSpanningDeltasIsCutOut) {
  StopChecker c(WithStops({"###"}), {kEos}, 0);
  StopUpdate u = c.Append(kText, "Hello #");
  EXPECT_EQ(u.text, "Hello ");
  EXPECT_EQ(u.finish, FinishReason::kNone);
  u = c.Append(kText, "#");
  EXPECT_EQ(u.text, "");
  EXPECT_EQ(c.held_bytes(), 2u);
  u = c.Append(kText, "# world");
  EXPECT_EQ(u.text, "");
  EXPECT_EQ(u.finish, FinishReason::kStop);
  EXPECT_EQ(u.stop_string_index, 0);
  EXPECT_EQ(u.stop_token, -1);
  // Finished: later calls change nothing.
  u = c.Append(kText, "more");
  EXPECT_EQ(u.text, "");
  EXPECT_EQ(u.finish, FinishReason::kStop);
  EXPECT_EQ(c.num_generated(), 3);
}

TEST(StopCheckerTest, HeldPrefixIsReleasedWhenItDoesNotContinue) {
  StopChecker c(WithStops({"STOP"}), {kEos}, 0);
  EXPECT_EQ(c.Append(kText, "ab ST").text, "ab ");
  EXPECT_EQ(c.Append(kText, "O").text, "");
  // "STOx" is no longer a prefix: all of it goes out.
  EXPECT_EQ(c.Append(kText, "x").text, "STOx");
  EXPECT_EQ(c.held_bytes(), 0u);
  // A suffix that restarts the stop string is held again.
  EXPECT_EQ(c.Append(kText, "SSS").text, "SS");
  EXPECT_EQ(c.held_bytes(), 1u);
}

TEST(StopCheckerTest, EarliestMatchWinsAcrossStopStrings) {
  StopChecker c(WithStops({"world", "lo w"}), {kEos}, 0);
  StopUpdate u = c.Append(kText, "hello world");
  EXPECT_EQ(u.text, "hel");
  EXPECT_EQ(u.stop_string_index, 1);
}

TEST(StopCheckerTest, MultiByteStopStringHoldsWholeCharacters) {
  StopChecker c(WithStops({"。\n"}), {kEos}, 0);
  EXPECT_EQ(c.Append(kText, "你好。").text, "你好");
  StopUpdate u = c.Append(kText, "\n再见");
  EXPECT_EQ(u.text, "");
  EXPECT_EQ(u.finish, FinishReason::kStop);
}

TEST(StopCheckerTest, EosEndsWithoutItsTextAndReleasesHeldText) {
  StopChecker c(WithStops({"<end>"}), {kEos}, 0);
  EXPECT_EQ(c.Append(kText, "x <e").text, "x ");
  StopUpdate u = c.Append(kEos, "[EOS]");
  EXPECT_EQ(u.text, "<e");
  EXPECT_EQ(u.finish, FinishReason::kStop);
  EXPECT_EQ(u.stop_token, kEos);
}

TEST(StopCheckerTest, IgnoreEosAndExtraStopIds) {
  SamplingParams p;
  p.ignore_eos = true;
  p.stop_token_ids = {7};
  StopChecker c(p, {kEos}, 0);
  EXPECT_EQ(c.Append(kEos, "e").finish, FinishReason::kNone);
  StopUpdate u = c.Append(7, "s");
  EXPECT_EQ(u.finish, FinishReason::kStop);
  EXPECT_EQ(u.stop_token, 7);
}

TEST(StopCheckerTest, MinTokensDefersStopsAndSuppressesStopIds) {
  SamplingParams p = WithStops({"!"});
  p.stop_token_ids = {7};
  p.min_tokens = 3;
  StopChecker c(p, {kEos, 5}, 0);
  EXPECT_THAT(c.SuppressedTokens(), ElementsAre(5, 7, kEos));
  EXPECT_EQ(c.Append(kEos, "").finish, FinishReason::kNone);
  StopUpdate u = c.Append(kText, "hi!");
  EXPECT_EQ(u.finish, FinishReason::kNone);
  EXPECT_EQ(u.text, "hi!");
  EXPECT_THAT(c.SuppressedTokens(), ElementsAre(5, 7, kEos));
  u = c.Append(kText, "a!b");  // third token: stops may end it now
  EXPECT_EQ(u.finish, FinishReason::kStop);
  EXPECT_EQ(u.text, "a");
  EXPECT_THAT(c.SuppressedTokens(), IsEmpty());
}

TEST(StopCheckerTest, MaxTokensAndContextRoomEndWithLength) {
  SamplingParams p = WithStops({"zz"});
  p.max_tokens = 2;
  StopChecker c(p, {kEos}, 0);
  EXPECT_EQ(c.max_new_tokens(), 2);
  EXPECT_EQ(c.Append(kText, "az").text, "a");
  StopUpdate u = c.Append(kText, "b");
  EXPECT_EQ(u.finish, FinishReason::kLength);
  EXPECT_EQ(u.text, "zb");
  // The context room caps max_tokens, and applies alone when max_tokens = 0.
  p.max_tokens = 100;
  EXPECT_EQ(StopChecker(p, {}, 5).max_new_tokens(), 5);
  p.max_tokens = 0;
  EXPECT_EQ(StopChecker(p, {}, 9).max_new_tokens(), 9);
  EXPECT_EQ(StopChecker(p, {}, 0).max_new_tokens(), 0);
  // A stop string completed by the last allowed token is a stop, not length.
  p.max_tokens = 1;
  StopChecker d(p, {}, 0);
  EXPECT_EQ(d.Append(kText, "zz").finish, FinishReason::kStop);
}

TEST(StopCheckerTest, FlushReleasesHeldText) {
  StopChecker c(WithStops({"abc"}), {kEos}, 0);
  EXPECT_EQ(c.Append(kText, "xab").text, "x");
  EXPECT_EQ(c.Flush(), "ab");
  EXPECT_EQ(c.finish_reason(), FinishReason::kCancelled);
}

// Whatever way a text is split into deltas, the streamed output is the text cut
// before the first stop-string match, and no step emits bytes beyond it.
TEST(StopCheckerTest, RandomSplitsNeverEmitPastTheStop) {
  std::mt19937 rng(5);
  const std::string alphabet = "abST";
  const std::vector<std::string> stops = {"STa", "bSb", "TTT"};
  for (int trial = 0; trial < 3000; ++trial) {
    std::string text;
    const int len = 1 + rng() % 30;
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    size_t cut = std::string::npos;
    for (const std::string& s : stops) cut = std::min(cut, text.find(s));
    const std::string want = cut == std::string::npos ? text : text.substr(0, cut);

    std::vector<std::string> deltas;
    for (size_t i = 0; i < text.size();) {
      const size_t n = std::min<size_t>(rng() % 4, text.size() - i);  // may be 0
      deltas.push_back(text.substr(i, n));
      i += n;
    }
    SamplingParams p = WithStops(stops);
    p.max_tokens = static_cast<int32_t>(deltas.size());
    StopChecker c(p, {kEos}, 0);
    std::string got;
    FinishReason finish = FinishReason::kNone;
    for (const std::string& d : deltas) {
      StopUpdate u = c.Append(kText, d);
      got += u.text;
      ASSERT_EQ(want.compare(0, got.size(), got), 0)
          << "emitted past the stop: text=" << text << " got=" << got;
      if (u.finish != FinishReason::kNone) {
        finish = u.finish;
        break;
      }
    }
    EXPECT_EQ(got, want) << text;
    EXPECT_EQ(finish,
              cut == std::string::npos ? FinishReason::kLength : FinishReason::kStop);
  }
}

}  // namespace
}  // namespace tandem::engine
