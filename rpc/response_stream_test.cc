#include "rpc/response_stream.h"

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"

namespace tandem::rpc {
namespace {

using tandem::v1::GenerateResponse;

GenerateResponse Tokens(std::vector<int> ids, bool logprobs, std::string text = "") {
  GenerateResponse m;
  m.set_request_id("r");
  for (int id : ids) {
    m.add_token_ids(id);
    if (logprobs) {
      auto* lp = m.add_logprobs();
      lp->set_token_id(id);
      lp->set_logprob(-0.25f * id);
    }
  }
  m.set_text(std::move(text));
  return m;
}

TEST(CoalesceResponseTest, ConcatenatesTokensLogprobsAndTextInOrder) {
  GenerateResponse a = Tokens({1, 2}, true, "ab");
  a.set_seed(7);
  GenerateResponse b = Tokens({3}, true, "c");
  ASSERT_TRUE(CoalesceResponse(&a, &b));
  ASSERT_EQ(a.token_ids_size(), 3);
  ASSERT_EQ(a.logprobs_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a.token_ids(i), i + 1);
    EXPECT_EQ(a.logprobs(i).token_id(), i + 1);  // each logprob stays with its token
    EXPECT_FLOAT_EQ(a.logprobs(i).logprob(), -0.25f * (i + 1));
  }
  EXPECT_EQ(a.text(), "abc");
  EXPECT_EQ(a.seed(), 7u);
  EXPECT_EQ(a.finish_reason(), tandem::v1::FINISH_REASON_UNSPECIFIED);
}

TEST(CoalesceResponseTest, KeepsTheFirstMessagesPromptLogprobsOnce) {
  GenerateResponse a = Tokens({1}, false);
  a.add_prompt_logprobs()->set_token_id(40);
  a.add_prompt_logprobs()->set_token_id(41);
  GenerateResponse b = Tokens({2}, false);
  ASSERT_TRUE(CoalesceResponse(&a, &b));
  ASSERT_EQ(a.prompt_logprobs_size(), 2);
  EXPECT_EQ(a.prompt_logprobs(1).token_id(), 41);
  // Held back with nothing, then the first message: its scores move along.
  GenerateResponse empty;
  empty.set_request_id("r");
  GenerateResponse c = Tokens({1}, false);
  c.add_prompt_logprobs()->set_token_id(40);
  ASSERT_TRUE(CoalesceResponse(&empty, &c));
  ASSERT_EQ(empty.prompt_logprobs_size(), 1);
  // Two messages that both carry scores are not merged.
  GenerateResponse d = Tokens({3}, false);
  d.add_prompt_logprobs()->set_token_id(50);
  EXPECT_FALSE(CoalesceResponse(&a, &d));
}

TEST(CoalesceResponseTest, TakesTheLastMessagesFinishAndUsage) {
  GenerateResponse a = Tokens({1}, false);
  GenerateResponse b = Tokens({2}, false);
  b.set_finish_reason(tandem::v1::FINISH_REASON_STOP);
  b.set_matched_stop("x");
  b.mutable_usage()->set_completion_tokens(2);
  ASSERT_TRUE(CoalesceResponse(&a, &b));
  EXPECT_EQ(a.token_ids_size(), 2);
  EXPECT_EQ(a.finish_reason(), tandem::v1::FINISH_REASON_STOP);
  EXPECT_EQ(a.matched_stop(), "x");
  EXPECT_EQ(a.usage().completion_tokens(), 2);
}

TEST(CoalesceResponseTest, RefusesWhatWouldChangeTheStream) {
  struct Case {
    const char* name;
    GenerateResponse pending, next;
  };
  std::vector<Case> cases;
  {
    Case c{"pending is a last message", Tokens({1}, false), Tokens({2}, false)};
    c.pending.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
    cases.push_back(c);
  }
  {
    Case c{"pending carries usage", Tokens({1}, false), Tokens({2}, false)};
    c.pending.mutable_usage()->set_completion_tokens(1);
    cases.push_back(c);
  }
  {
    Case c{"other request", Tokens({1}, false), Tokens({2}, false)};
    c.next.set_request_id("other");
    cases.push_back(c);
  }
  cases.push_back({"logprobs on one side only", Tokens({1}, true), Tokens({2}, false)});
  {
    Case c{"misaligned logprobs", Tokens({1, 2}, true), Tokens({3}, true)};
    c.pending.mutable_logprobs()->RemoveLast();
    cases.push_back(c);
  }
  {
    Case c{"different seeds", Tokens({1}, false), Tokens({2}, false)};
    c.pending.set_seed(1);
    c.next.set_seed(2);
    cases.push_back(c);
  }
  for (Case& c : cases) {
    const std::string before = c.pending.SerializeAsString();
    EXPECT_FALSE(CoalesceResponse(&c.pending, &c.next)) << c.name;
    EXPECT_EQ(c.pending.SerializeAsString(), before) << c.name;
  }
}

// A Router whose Generate streams `n` single-token messages pushed from a
// producer thread as fast as it can (faster than gRPC writes them), then
// closes with usage on the last one.
class PushingRouter final : public tandem::v1::Router::CallbackService {
 public:
  explicit PushingRouter(int n) : n_(n) {}
  ~PushingRouter() override {
    for (auto& t : producers_) t.join();
  }
  grpc::ServerWriteReactor<GenerateResponse>* Generate(
      grpc::CallbackServerContext*, const tandem::v1::GenerateRequest*) override {
    auto* stream = new ResponseStream();
    producers_.emplace_back([this, stream] {
      for (int i = 0; i < n_; ++i) {
        GenerateResponse m = Tokens({i}, true, std::to_string(i % 10));
        if (i == n_ - 1) {
          m.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
          m.mutable_usage()->set_completion_tokens(n_);
        }
        stream->Push(std::move(m));
      }
      coalesced_ = stream->coalesced();
      stream->Close(grpc::Status::OK);
    });
    return stream;
  }
  int64_t coalesced() const { return coalesced_; }

 private:
  const int n_;
  std::vector<std::thread> producers_;
  std::atomic<int64_t> coalesced_{0};
};

TEST(ResponseStreamTest, CoalescedStreamCarriesEveryTokenInOrderAndEndsOnce) {
  constexpr int kTokens = 2000;
  PushingRouter service(kTokens);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  auto stub = tandem::v1::Router::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, tandem::v1::GenerateRequest());
  GenerateResponse m;
  std::vector<int> ids;
  std::string text, expected_text;
  int messages = 0, finishes = 0;
  bool finish_last = true;
  while (reader->Read(&m)) {
    ++messages;
    if (finishes > 0) finish_last = false;  // anything after the last message
    ASSERT_EQ(m.logprobs_size(), m.token_ids_size());
    for (int i = 0; i < m.token_ids_size(); ++i) {
      EXPECT_EQ(m.logprobs(i).token_id(), m.token_ids(i));
      ids.push_back(m.token_ids(i));
    }
    text += m.text();
    if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
      ++finishes;
      EXPECT_EQ(m.usage().completion_tokens(), kTokens);
    } else {
      EXPECT_FALSE(m.has_usage());
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(ids.size(), static_cast<size_t>(kTokens));
  for (int i = 0; i < kTokens; ++i) {
    ASSERT_EQ(ids[i], i);
    expected_text += std::to_string(i % 10);
  }
  EXPECT_EQ(text, expected_text);
  EXPECT_EQ(finishes, 1);
  EXPECT_TRUE(finish_last);
  server->Shutdown();
  std::printf("%d messages carried %d tokens\n", messages, kTokens);
  // Every pushed message arrived alone or merged: the two counts add up.
  EXPECT_EQ(messages + service.coalesced(), kTokens);
}

}  // namespace
}  // namespace tandem::rpc
