#include "gateway/sse.h"

#include "gtest/gtest.h"

namespace tandem::gateway {
namespace {

TEST(SseTest, EventFraming) {
  EXPECT_EQ(SseEvent("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseEvent(""), "data: \n\n");
  EXPECT_EQ(SseEvent("a\nb"), "data: a\ndata: b\n\n");
  EXPECT_EQ(SseEvent("a\r\nb"), "data: a\ndata: b\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
}

TEST(SseTest, ParserRoundTripsAnySplit) {
  const std::vector<std::string> data = {"{\"x\":1}", "two\nlines", "", "[DONE]"};
  std::string wire;
  for (const auto& d : data) wire += SseEvent(d);
  wire.insert(wire.find("two"), "\r");  // a CR is dropped wherever it is
  for (size_t split = 1; split <= wire.size(); ++split) {
    SseParser parser;
    std::vector<std::string> events;
    for (size_t i = 0; i < wire.size(); i += split) {
      parser.Feed(absl::string_view(wire).substr(i, split), &events);
    }
    EXPECT_EQ(events, data) << "split " << split;
  }
}

TEST(SseTest, ParserIgnoresCommentsAndOtherFields) {
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(": keep-alive\n\nevent: x\nid: 3\ndata:no-space\r\n\r\n", &events);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], "no-space");
}

}  // namespace
}  // namespace tandem::gateway
