// The gateway in process (HttpServer + OpenAIService + RouterClient) against
// the scripted test router over real loopback sockets.
#include "gateway/openai_service.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/router_client.h"
#include "gateway/sse.h"
#include "gateway/testing/scripted_router.h"
#include "gtest/gtest.h"
#include "http/server.h"
#include "metrics/http_get.h"
#include "metrics/registry.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

using json = nlohmann::json;

// Parameters: RouterClient::Options::sessions (0: one Generate call per
// choice; 2: multiplexed on GenerateSession streams, as gateway_main runs) and
// OpenAIServiceOptions::stream_interval.
struct Transport {
  int sessions = 0;
  int stream_interval = 1;
};

class OpenAIServiceTest : public ::testing::TestWithParam<Transport> {
 protected:
  static void SetUpTestSuite() {
    auto t = tokenizer::Tokenizer::Load("third_party/kimi_k3_tokenizer");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }

  void SetUp() override {
    router_service_ = std::make_unique<testing::ScriptedRouter>(
        tokenizer_, testing::ScriptedRouter::Options{.max_context_tokens = 4096},
        [this](const json& e) {
          absl::MutexLock lock(&mu_);
          events_.push_back(e);
        });
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(router_service_.get());
    grpc_server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    client_ = std::make_unique<RouterClient>(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                            grpc::InsecureChannelCredentials()),
        RouterClient::Options{.sessions = GetParam().sessions});
    service_ = std::make_unique<OpenAIService>(
        OpenAIServiceOptions{.api_key = "sekrit",
                             .stream_interval = GetParam().stream_interval},
        tokenizer_, client_.get(), &registry_);
    http_ = std::make_unique<http::HttpServer>(
        http::HttpServerOptions{},
        [this](http::HttpRequest r, std::shared_ptr<http::ResponseWriter> w) {
          service_->Handle(std::move(r), std::move(w));
        },
        &OpenAIService::FormatServerError);
    ASSERT_TRUE(http_->Start().ok());
  }

  void TearDown() override {
    http_->Shutdown(absl::Seconds(2));
    service_->CancelAll(absl::Seconds(5));
    http_.reset();
    service_.reset();
    client_.reset();  // closes its sessions
    grpc_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  absl::StatusOr<metrics::HttpResponse> Post(const std::string& path, const json& body,
                                             const std::string& key = "sekrit") {
    return Post(path, body.dump(), key);
  }
  absl::StatusOr<metrics::HttpResponse> Post(const std::string& path,
                                             const std::string& body,
                                             const std::string& key = "sekrit") {
    auto conn =
        metrics::HttpConnection::Connect("127.0.0.1", http_->port(), absl::Seconds(10));
    if (!conn.ok()) return conn.status();
    metrics::HttpHeaders headers = {{"Content-Type", "application/json"}};
    if (!key.empty()) headers.emplace_back("Authorization", "Bearer " + key);
    return (*conn)->Request("POST", path, headers, body, absl::Seconds(30));
  }

  // Waits until an event with `name` for `request_id_prefix` was seen.
  bool WaitForEvent(const std::string& name, const std::string& request_id_prefix) {
    absl::MutexLock lock(&mu_);
    auto seen = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const json& e : events_) {
        if (e["event"] == name &&
            e["request_id"].get<std::string>().rfind(request_id_prefix, 0) == 0) {
          return true;
        }
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), absl::Seconds(20));
  }

  // Tokens the scripted router sent, once `streams` of its streams have ended:
  // the router records "done" after its last write, which can reach the client
  // (and end the HTTP response) before the record is made.
  int SentTokens(int streams = 1) {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      int n = 0;
      for (const json& e : events_) n += e["event"] == "done";
      return n >= streams;
    };
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(20)))
        << "the scripted router did not end " << streams << " stream(s)";
    int total = 0;
    for (const json& e : events_) {
      if (e["event"] == "done") total += e["sent"].get<int>();
    }
    return total;
  }

  json ChatBody(const std::string& user, json extra = json::object()) {
    json body = {{"model", "kimi-k3"},
                 {"messages", json::array({{{"role", "user"}, {"content", user}}})}};
    for (auto& [k, v] : extra.items()) body[k] = v;
    return body;
  }

  static tokenizer::Tokenizer* tokenizer_;
  absl::Mutex mu_;
  std::vector<json> events_ ABSL_GUARDED_BY(mu_);
  metrics::Registry registry_;
  std::unique_ptr<testing::ScriptedRouter> router_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<RouterClient> client_;
  std::unique_ptr<OpenAIService> service_;
  std::unique_ptr<http::HttpServer> http_;
};

tokenizer::Tokenizer* OpenAIServiceTest::tokenizer_ = nullptr;

// --stream_interval: after the first (sent at once), a streamed choice's tokens
// go out in chunks of at least `interval` tokens (the last may be shorter),
// exactly `interval` when the router sends one token per message; every token
// once, in order.
TEST_P(OpenAIServiceTest, StreamIntervalHoldsTokensUntilEnoughAreReady) {
  const int interval = GetParam().stream_interval;
  const json body = {{"model", "kimi-k3"},
                     {"prompt", "Say something #tokens:37 #per_message:1"},
                     {"stream", true},
                     {"logprobs", 0},
                     {"stream_options", {{"include_usage", true}}}};
  auto r = Post("/v1/completions", body);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(r->body, &events);
  std::vector<int> per_chunk;  // tokens in each text chunk
  std::string text;
  int completion_tokens = -1;
  for (const std::string& e : events) {
    if (e == "[DONE]") continue;
    const json j = json::parse(e);
    if (j.contains("usage") && !j["usage"].is_null()) {
      completion_tokens = j["usage"]["completion_tokens"].get<int>();
      continue;
    }
    const json& c = j["choices"][0];
    if (!c["finish_reason"].is_null() && c["text"].get<std::string>().empty()) continue;
    per_chunk.push_back(static_cast<int>(c["logprobs"]["tokens"].size()));
    text += c["text"].get<std::string>();
  }
  ASSERT_FALSE(per_chunk.empty());
  int total = 0;
  if (GetParam().sessions == 0) EXPECT_EQ(per_chunk[0], 1);  // the first at once
  for (size_t k = 0; k < per_chunk.size(); ++k) {
    total += per_chunk[k];
    if (k == 0) continue;
    if (k + 1 == per_chunk.size()) break;  // the last may be shorter
    if (GetParam().sessions == 0) {
      EXPECT_EQ(per_chunk[k], interval) << "chunk " << k;  // one token per message
    } else {
      EXPECT_GE(per_chunk[k], interval) << "chunk " << k;  // merged messages
    }
  }
  EXPECT_EQ(total, completion_tokens);
  EXPECT_EQ(completion_tokens, 38);  // 37 filler tokens (" la" each) and [EOS]
  std::string expected;
  for (int k = 0; k < 37; ++k) expected += " la";
  EXPECT_EQ(text, expected);
}

INSTANTIATE_TEST_SUITE_P(
    RouterTransport, OpenAIServiceTest,
    ::testing::Values(Transport{.sessions = 0}, Transport{.sessions = 2},
                      Transport{.sessions = 0, .stream_interval = 4},
                      Transport{.sessions = 2, .stream_interval = 4}),
    [](const ::testing::TestParamInfo<Transport>& info) {
      if (info.param.stream_interval > 1) {
        return std::string(info.param.sessions == 0 ? "PerRequestCallsStreamInterval4"
                                                    : "SessionsStreamInterval4");
      }
      return info.param.sessions == 0 ? std::string("PerRequestCalls")
                                      : std::string("Sessions");
    });

TEST_P(OpenAIServiceTest, ChatCompletionWithReasoningAndUsage) {
  auto r = Post("/v1/chat/completions", ChatBody("Hi", {{"seed", 7}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["model"], "kimi-k3");
  ASSERT_EQ(j["choices"].size(), 1u);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["index"], 0);
  EXPECT_EQ(c["finish_reason"], "stop");
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_EQ(c["message"]["content"],
            "Hello! The quick brown fox jumps over the lazy dog. seed=7");
  EXPECT_EQ(c["message"]["reasoning_content"], "The user wants an answer.");
  EXPECT_EQ(j["usage"]["completion_tokens"], SentTokens());
  EXPECT_EQ(j["usage"]["total_tokens"].get<int>(),
            j["usage"]["prompt_tokens"].get<int>() +
                j["usage"]["completion_tokens"].get<int>());
  {
    absl::MutexLock lock(&mu_);
    ASSERT_FALSE(events_.empty());
    EXPECT_EQ(events_[0]["prompt_tokens"], j["usage"]["prompt_tokens"]);
    EXPECT_EQ(events_[0]["seed"], 7);
  }
}

TEST_P(OpenAIServiceTest, StreamingChunksRoleDeltasUsageDone) {
  auto r = Post("/v1/chat/completions",
                ChatBody("Hi", {{"stream", true},
                                {"stream_options", {{"include_usage", true}}},
                                {"chat_template_kwargs", {{"thinking", false}}}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  EXPECT_EQ(r->Header("Content-Type").rfind("text/event-stream", 0), 0u);
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(r->body, &events);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  std::string finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json e = json::parse(events[i]);
    const json& d = e["choices"][0]["delta"];
    EXPECT_FALSE(d.contains("reasoning_content"));  // thinking off
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null())
      finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(content, "Hello! The quick brown fox jumps over the lazy dog.");
  EXPECT_EQ(finish, "stop");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], SentTokens());
}

// The streamed chunks are rendered without building json objects; each must
// still be exactly what dumping its json gives (nlohmann's sorted keys and
// escaping), for chat (reasoning, content, role) and completions, with and
// without usage.
TEST_P(OpenAIServiceTest, StreamedChunksAreCanonicalJson) {
  const std::vector<std::pair<std::string, json>> requests = {
      {"/v1/chat/completions", ChatBody("Hi", {{"stream", true}})},
      {"/v1/chat/completions",
       ChatBody("Hi \"quoted\"\n", {{"stream", true},
                                    {"stream_options", {{"include_usage", true}}},
                                    {"chat_template_kwargs", {{"thinking", false}}}})},
      {"/v1/completions", json{{"model", "kimi-k3"},
                               {"prompt", "Say something"},
                               {"n", 2},
                               {"stream", true}}},
      {"/v1/completions", json{{"model", "kimi-k3"},
                               {"prompt", "Say something"},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}}}},
  };
  for (const auto& [path, body] : requests) {
    auto r = Post(path, body);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->status_code, 200) << r->body;
    SseParser parser;
    std::vector<std::string> events;
    parser.Feed(r->body, &events);
    ASSERT_GE(events.size(), 3u) << r->body;
    EXPECT_EQ(events.back(), "[DONE]");
    bool saw_text = false, saw_finish = false;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      const json e = json::parse(events[i]);
      EXPECT_EQ(e.dump(-1, ' ', false, json::error_handler_t::replace), events[i]);
      EXPECT_EQ(e.contains("usage"), body.contains("stream_options")) << events[i];
      if (e["choices"].empty()) continue;
      const json& c = e["choices"][0];
      if (c.contains("delta") ? c["delta"].contains("content") ||
                                    c["delta"].contains("reasoning_content")
                              : !c["text"].get<std::string>().empty()) {
        saw_text = true;
      }
      if (!c["finish_reason"].is_null()) saw_finish = true;
    }
    EXPECT_TRUE(saw_text) << r->body;
    EXPECT_TRUE(saw_finish) << r->body;
  }
}

// Completions' echo (lm-evaluation-harness's loglikelihood requests: echo,
// logprobs, max_tokens 1) and vLLM's prompt_logprobs, from the scores the
// router sends on its first message (the scripted router makes them up:
// token k scored -1 - 0.25 (k % 5), rank 1 + k % 3).
TEST_P(OpenAIServiceTest, EchoAndPromptLogprobs) {
  const std::string prompt = "Say something";
  const std::vector<int> ids = *tokenizer_->Encode(prompt);
  ASSERT_GE(ids.size(), 2u);
  auto post = [&](json body) {
    auto r = Post("/v1/completions", body);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 200) << r->body;
    return json::parse(r->body);
  };
  const json base = {{"model", "kimi-k3"}, {"prompt", prompt}, {"max_tokens", 3}};
  const std::string completion = post(base)["choices"][0]["text"];
  json echo = base;
  echo["echo"] = true;
  const json e = post(echo)["choices"][0];
  EXPECT_EQ(e["text"], prompt + completion);
  EXPECT_EQ(e["logprobs"], nullptr);

  echo["logprobs"] = 2;
  const json lp = post(echo)["choices"][0];
  EXPECT_EQ(lp["text"], prompt + completion);
  const json& l = lp["logprobs"];
  ASSERT_EQ(l["tokens"].size(), ids.size() + 3);
  ASSERT_EQ(l["token_logprobs"].size(), ids.size() + 3);
  ASSERT_EQ(l["text_offset"].size(), ids.size() + 3);
  EXPECT_EQ(l["token_logprobs"][0], nullptr);
  EXPECT_EQ(l["top_logprobs"][0], nullptr);
  std::string joined;
  for (size_t k = 0; k < ids.size() + 3; ++k) {
    EXPECT_EQ(l["text_offset"][k], joined.size()) << k;
    joined += l["tokens"][k].get<std::string>();
    if (k == 0) continue;
    if (k < ids.size()) {
      EXPECT_FLOAT_EQ(l["token_logprobs"][k].get<float>(), -1.0f - 0.25f * (k % 5))
          << k;
    }
    EXPECT_EQ(l["top_logprobs"][k].size(), 2u) << k;
  }
  EXPECT_EQ(joined, prompt + completion);

  json vllm = base;
  vllm["prompt_logprobs"] = 1;
  const json v = post(vllm)["choices"][0];
  EXPECT_EQ(v["text"], completion);
  ASSERT_EQ(v["prompt_logprobs"].size(), ids.size());
  EXPECT_EQ(v["prompt_logprobs"][0], nullptr);
  for (size_t k = 1; k < ids.size(); ++k) {
    const json& entry = v["prompt_logprobs"][k];
    const json& own = entry[std::to_string(ids[k])];
    EXPECT_FLOAT_EQ(own["logprob"].get<float>(), -1.0f - 0.25f * (k % 5)) << k;
    EXPECT_EQ(own["rank"], 1 + k % 3) << k;
    EXPECT_EQ(own["decoded_token"], *tokenizer_->IdToken(ids[k]));
    EXPECT_EQ(entry.size(), 2u) << entry.dump();  // its own token + 1 alternative
  }

  // Both at once: the calls ask for the larger count, each output keeps its own.
  json both = echo;
  both["prompt_logprobs"] = 1;  // echo's logprobs: 2
  const json b = post(both)["choices"][0];
  EXPECT_EQ(b["logprobs"]["top_logprobs"][1].size(), 2u);
  EXPECT_EQ(b["prompt_logprobs"][1].size(), 2u);  // its own token + 1

  // Streamed: the prompt (with its logprobs) is the first chunk, then the
  // output as without echo.
  echo["stream"] = true;
  auto st = Post("/v1/completions", echo);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->status_code, 200) << st->body;
  std::string text;
  std::vector<std::string> tokens;
  bool first = true;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(st->body, &events);
  for (const std::string& data : events) {
    if (data == "[DONE]") break;
    const json c = json::parse(data)["choices"][0];
    if (first) {
      EXPECT_EQ(c["text"], prompt);
      ASSERT_EQ(c["logprobs"]["tokens"].size(), ids.size());
      EXPECT_EQ(c["logprobs"]["token_logprobs"][0], nullptr);
      first = false;
    }
    text += c["text"].get<std::string>();
    if (!c["logprobs"].is_null()) {
      for (const json& t : c["logprobs"]["tokens"]) tokens.push_back(t);
    }
  }
  EXPECT_EQ(text, prompt + completion);
  EXPECT_EQ(tokens.size(), ids.size() + 3);

  // Chat: vLLM's top-level prompt_logprobs; not with streaming.
  auto chat = Post("/v1/chat/completions", ChatBody("hi", {{"prompt_logprobs", 0}}));
  ASSERT_TRUE(chat.ok()) << chat.status();
  ASSERT_EQ(chat->status_code, 200) << chat->body;
  const json cj = json::parse(chat->body);
  EXPECT_EQ(cj["prompt_logprobs"].size(), cj["usage"]["prompt_tokens"].get<size_t>());
  auto streamed = Post("/v1/chat/completions",
                       ChatBody("hi", {{"prompt_logprobs", 0}, {"stream", true}}));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->status_code, 400) << streamed->body;
  EXPECT_EQ(json::parse(streamed->body)["error"]["param"], "prompt_logprobs");
}

// vLLM's echo without generation (`echo` + `max_tokens: 0`): the prompt and
// its scores, no generated text, finish_reason "length", 0 completion tokens;
// streamed as the prompt chunk and the finish. max_tokens 0 without echo, or
// in a chat, is a 400 naming max_tokens.
TEST_P(OpenAIServiceTest, EchoWithMaxTokensZeroScoresThePromptOnly) {
  const std::string prompt = "Say something";
  const std::vector<int> ids = *tokenizer_->Encode(prompt);
  ASSERT_GE(ids.size(), 2u);
  const json body = {{"model", "kimi-k3"},
                     {"prompt", prompt},
                     {"max_tokens", 0},
                     {"echo", true},
                     {"logprobs", 1}};
  auto r = Post("/v1/completions", body);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  const json j = json::parse(r->body);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["text"], prompt);
  EXPECT_EQ(c["finish_reason"], "length");
  ASSERT_EQ(c["logprobs"]["tokens"].size(), ids.size());
  EXPECT_EQ(c["logprobs"]["token_logprobs"][0], nullptr);
  for (size_t k = 1; k < ids.size(); ++k) {
    EXPECT_FLOAT_EQ(c["logprobs"]["token_logprobs"][k].get<float>(),
                    -1.0f - 0.25f * (k % 5))
        << k;
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], 0);
  EXPECT_EQ(j["usage"]["prompt_tokens"], ids.size());

  json streamed = body;
  streamed["stream"] = true;
  auto st = Post("/v1/completions", streamed);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->status_code, 200) << st->body;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(st->body, &events);
  std::string text, finish;
  size_t tokens = 0;
  for (const std::string& data : events) {
    if (data == "[DONE]") break;
    const json e = json::parse(data)["choices"][0];
    text += e["text"].get<std::string>();
    if (!e["logprobs"].is_null()) tokens += e["logprobs"]["tokens"].size();
    if (!e["finish_reason"].is_null()) finish = e["finish_reason"];
  }
  EXPECT_EQ(text, prompt);
  EXPECT_EQ(tokens, ids.size());
  EXPECT_EQ(finish, "length");

  for (const json& bad :
       {json{{"model", "kimi-k3"}, {"prompt", prompt}, {"max_tokens", 0}},
        json{{"model", "kimi-k3"},
             {"messages", {{{"role", "user"}, {"content", "hi"}}}},
             {"max_tokens", 0}}}) {
    const bool chat = bad.contains("messages");
    auto e = Post(chat ? "/v1/chat/completions" : "/v1/completions", bad);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->status_code, 400) << e->body;
    EXPECT_EQ(json::parse(e->body)["error"]["param"], "max_tokens") << e->body;
  }
}

TEST_P(OpenAIServiceTest, CompletionsNWithSeedsAndStop) {
  auto r = Post("/v1/completions", json{{"model", "kimi-k3"},
                                        {"prompt", "Say something"},
                                        {"n", 3},
                                        {"seed", 11},
                                        {"stop", {"lazy"}}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], " The quick brown fox jumps over the ");
    EXPECT_EQ(j["choices"][i]["finish_reason"], "stop");
  }
  // Distinct seeds went to the router, the first one being `seed` itself.
  absl::MutexLock lock(&mu_);
  std::set<uint64_t> seeds;
  for (const json& e : events_) {
    if (e["event"] == "generate") seeds.insert(e["seed"].get<uint64_t>());
  }
  EXPECT_EQ(seeds.size(), 3u);
  EXPECT_TRUE(seeds.count(11));
}

TEST_P(OpenAIServiceTest, LogitBiasReachesTheRouter) {
  auto r = Post("/v1/chat/completions",
                json{{"model", "kimi-k3"},
                     {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"logit_bias", {{"15", -100}, {"7", 2.5}}}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  auto bad =
      Post("/v1/completions",
           json{{"model", "kimi-k3"}, {"prompt", "x"}, {"logit_bias", {{"7", 101}}}});
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->status_code, 400) << bad->body;
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "logit_bias") << bad->body;
  absl::MutexLock lock(&mu_);
  int generates = 0;
  for (const json& e : events_) {
    if (e["event"] != "generate") continue;
    ++generates;
    EXPECT_EQ(e["logit_bias"], (json{{"15", -100.0}, {"7", 2.5}})) << e.dump();
  }
  EXPECT_EQ(generates, 1);
}

// vLLM's /tokenize and /detokenize: the same ids the generation endpoints send
// (a chat's count is its completion's usage.prompt_tokens), round trips, and
// errors naming the field.
TEST_P(OpenAIServiceTest, TokenizeAndDetokenize) {
  const std::string text = "Hello, tokenizer! \u00e9t\u00e9 \U0001F600";
  auto t = Post("/tokenize", json{{"prompt", text}, {"return_token_strs", true}});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->status_code, 200) << t->body;
  const json tj = json::parse(t->body);
  const std::vector<int> want = *tokenizer_->Encode(text);
  EXPECT_EQ(tj["tokens"].get<std::vector<int>>(), want);
  EXPECT_EQ(tj["count"], want.size());
  EXPECT_EQ(tj["max_model_len"], 4096);
  ASSERT_EQ(tj["token_strs"].size(), want.size());
  EXPECT_EQ(tj["token_strs"][0], "Hello");
  auto d = Post("/detokenize", json{{"model", "kimi-k3"}, {"tokens", tj["tokens"]}});
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->status_code, 200) << d->body;
  EXPECT_EQ(json::parse(d->body)["prompt"], text);

  // A chat: the ids /v1/chat/completions sends (its prompt_tokens), and one
  // token longer prompt than without the generation prompt's header.
  const json chat = ChatBody("What is 2+2?");
  auto c = Post("/tokenize", chat);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->status_code, 200) << c->body;
  const json cj = json::parse(c->body);
  EXPECT_EQ(cj["token_strs"], nullptr);
  auto g = Post("/v1/chat/completions", chat);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->status_code, 200) << g->body;
  EXPECT_EQ(cj["count"], json::parse(g->body)["usage"]["prompt_tokens"]);
  json no_prompt = chat;
  no_prompt["add_generation_prompt"] = false;
  auto h = Post("/tokenize", no_prompt);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->status_code, 200) << h->body;
  const json hj = json::parse(h->body);
  EXPECT_LT(hj["count"].get<int>(), cj["count"].get<int>());
  // Without the generation prompt the ids are a prefix of those with it.
  const std::vector<int> with = cj["tokens"].get<std::vector<int>>();
  const std::vector<int> without = hj["tokens"].get<std::vector<int>>();
  EXPECT_TRUE(std::equal(without.begin(), without.end(), with.begin()));
  // A special token is kept by /detokenize.
  auto sp = Post("/detokenize", json{{"tokens", {tokenizer_->eos_id()}}});
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_EQ(json::parse(sp->body)["prompt"],
            *tokenizer_->IdToken(tokenizer_->eos_id()));

  struct Bad {
    const char* path;
    json body;
    int status;
    const char* param;
  };
  const Bad bad[] = {
      {"/tokenize", json{{"model", "nope"}, {"prompt", "x"}}, 404, "model"},
      {"/tokenize", json{{"prompt", "x"}, {"messages", json::array()}}, 400, "prompt"},
      {"/tokenize", json::object(), 400, "prompt"},
      {"/tokenize", json{{"prompt", 5}}, 400, "prompt"},
      {"/detokenize", json::object(), 400, "tokens"},
      {"/detokenize", json{{"tokens", {1, -2}}}, 400, "tokens[1]"},
      {"/detokenize", json{{"tokens", {1, 1 << 30}}}, 400, "tokens[1]"},
  };
  for (const Bad& b : bad) {
    auto r = Post(b.path, b.body);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, b.status) << b.path << " " << b.body.dump() << r->body;
    EXPECT_EQ(json::parse(r->body)["error"]["param"], b.param) << r->body;
  }
  // The API key is required, as on /v1.
  auto anon = Post("/tokenize", json{{"prompt", "x"}}, "");
  ASSERT_TRUE(anon.ok()) << anon.status();
  EXPECT_EQ(anon->status_code, 401);
}

// engine/media/testdata/rgb_3x2.png.
const std::string kPng3x2 =
    "iVBORw0KGgoAAAANSUhEUgAAAAMAAAACCAIAAAASFvFNAAAAGElEQVR4nGP4z8DA8J+BgeE/"
    "I5eIHAQAADEzA++e06gjAAAAAElFTkSuQmCC";

json ImageChatBody(const std::string& url) {
  return json{{"model", "kimi-k3"},
              {"messages",
               {{{"role", "user"},
                 {"content",
                  {{{"type", "image_url"}, {"image_url", {{"url", url}}}},
                   {{"type", "text"}, {"text", "what is this?"}}}}}}}};
}

TEST_P(OpenAIServiceTest, ImageChatIsSentWithItsImages) {
  // The image's <|media_begin|> "image 3x2" <|media_content|> <|media_pad|>
  // <|media_end|> are prompt tokens.
  json text_only = ImageChatBody("x");
  text_only["messages"][0]["content"] = {{{"type", "text"}, {"text", "what is this?"}}};
  auto plain = Post("/v1/chat/completions", text_only);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_EQ(plain->status_code, 200) << plain->body;
  auto r =
      Post("/v1/chat/completions", ImageChatBody("data:image/png;base64," + kPng3x2));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status_code, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(),
            json::parse(plain->body)["usage"]["prompt_tokens"].get<int>() + 3);
}

TEST_P(OpenAIServiceTest, ErrorCases) {
  struct Case {
    std::string path;
    std::string body;
    std::string key;
    int status;
    std::string code;  // "" for null
    std::string param;
  };
  const json ok = ChatBody("Hi");
  json unknown = ok;
  unknown["model"] = "nope";
  const std::vector<Case> cases = {
      {"/v1/chat/completions", ok.dump(), "", 401, "invalid_api_key", ""},
      {"/v1/chat/completions", ok.dump(), "wrong", 401, "invalid_api_key", ""},
      {"/v1/chat/completions", "{not json", "sekrit", 400, "", ""},
      {"/v1/chat/completions", ChatBody("Hi", {{"temperature", "x"}}).dump(), "sekrit",
       400, "", "temperature"},
      {"/v1/chat/completions", ChatBody("Hi", {{"top_p", 7}}).dump(), "sekrit", 400, "",
       "top_p"},
      {"/v1/chat/completions", unknown.dump(), "sekrit", 404, "model_not_found",
       "model"},
      {"/v1/chat/completions", ChatBody("Hi", {{"max_tokens", 5000}}).dump(), "sekrit",
       400, "context_length_exceeded", "messages"},
      {"/v1/completions",
       json{{"model", "kimi-k3"}, {"prompt", "x"}, {"echo", "yes"}}.dump(), "sekrit",
       400, "", "echo"},
      {"/v1/completions", json{{"model", "kimi-k3"}, {"prompt", {1, 999999}}}.dump(),
       "sekrit", 400, "", "prompt"},
      {"/v1/chat/completions", ChatBody("#error:RESOURCE_EXHAUSTED").dump(), "sekrit",
       429, "rate_limit_exceeded", ""},
      {"/v1/chat/completions", ChatBody("#error:UNAVAILABLE").dump(), "sekrit", 503,
       "service_unavailable", ""},
      {"/v1/nothing", "{}", "sekrit", 404, "unknown_url", ""},
      // Image parts: a bad image is a 400 naming its part (a good one is
      // served: ImageChatIsSentWithItsImages).
      {"/v1/chat/completions",
       ImageChatBody("data:image/jpeg;base64," + kPng3x2).dump(), "sekrit", 400, "",
       "messages[0].content[0].image_url"},
      {"/v1/chat/completions", ImageChatBody("data:image/png;base64,AAAA").dump(),
       "sekrit", 400, "", "messages[0].content[0].image_url"},
      {"/v1/chat/completions", ImageChatBody("https://example.com/a.png").dump(),
       "sekrit", 400, "", "messages[0].content[0].image_url"},
  };
  for (const Case& c : cases) {
    auto r = Post(c.path, c.body, c.key);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, c.status) << c.body << " -> " << r->body;
    json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
    EXPECT_EQ(j["error"]["code"], c.code.empty() ? json(nullptr) : json(c.code))
        << r->body;
    EXPECT_EQ(j["error"]["param"], c.param.empty() ? json(nullptr) : json(c.param))
        << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    if (c.status == 429 || c.status == 503) EXPECT_EQ(r->Header("Retry-After"), "1");
  }
}

TEST_P(OpenAIServiceTest, ResetPrefixCacheNeedsTheKeyAndReportsFailures) {
  // Without the key, or with a wrong one: 401, and the router is not called.
  for (const std::string key : {"", "wrong"}) {
    auto r = Post("/v1/admin/reset_prefix_cache", std::string(), key);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 401) << r->body;
    EXPECT_EQ(json::parse(r->body)["error"]["code"], "invalid_api_key");
  }
  EXPECT_EQ(router_service_->reset_calls(), 0);
  // Other methods: 405 naming POST.
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", http_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto get =
      (*conn)->Request("GET", "/v1/admin/reset_prefix_cache",
                       {{"Authorization", "Bearer sekrit"}}, "", absl::Seconds(10));
  ASSERT_TRUE(get.ok());
  EXPECT_EQ(get->status_code, 405) << get->body;
  EXPECT_EQ(get->Header("Allow"), "POST");
  EXPECT_EQ(router_service_->reset_calls(), 0);

  // Every worker reset: 200 listing them; vLLM's path is the same endpoint.
  for (const std::string path :
       {"/v1/admin/reset_prefix_cache", "/reset_prefix_cache"}) {
    auto r = Post(path, std::string());
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->status_code, 200) << path << " -> " << r->body;
    json j = json::parse(r->body);
    EXPECT_EQ(j["reset"], json::array({"prefill-0", "decode-0"})) << r->body;
    EXPECT_FALSE(j.contains("failed"));
  }
  EXPECT_EQ(router_service_->reset_calls(), 2);

  // One worker failed: 503 naming it, not a silent 200.
  tandem::v1::ResetPrefixCacheResponse partial;
  partial.add_reset("prefill-0");
  auto* f = partial.add_failed();
  f->set_worker_id("decode-0");
  f->set_role("decode");
  f->set_error("DEADLINE_EXCEEDED: late");
  router_service_->SetResetAnswer(grpc::Status::OK, partial);
  auto r = Post("/v1/admin/reset_prefix_cache", std::string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 503) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["reset"], json::array({"prefill-0"}));
  ASSERT_EQ(j["failed"].size(), 1u) << r->body;
  EXPECT_EQ(j["failed"][0]["worker_id"], "decode-0");
  EXPECT_EQ(j["failed"][0]["role"], "decode");
  EXPECT_EQ(j["failed"][0]["error"], "DEADLINE_EXCEEDED: late");
  EXPECT_EQ(j["error"]["code"], "partial_reset");

  // The router refusing (no live worker): its error, 503.
  router_service_->SetResetAnswer(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, "no live worker"), {});
  r = Post("/v1/admin/reset_prefix_cache", std::string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 503) << r->body;
  EXPECT_NE(r->body.find("no live worker"), std::string::npos) << r->body;
}

TEST_P(OpenAIServiceTest, ClientDisconnectCancelsRouterCall) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(http_->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string body = ChatBody("#tokens:100000000", {{"stream", true}}).dump();
  const std::string req =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
      "Authorization: Bearer sekrit\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("la") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_GT(poll(&p, 1, 20000), 0);
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    got.append(buf, n);
  }
  close(fd);
  EXPECT_TRUE(WaitForEvent("cancelled", "chatcmpl-"));
  EXPECT_TRUE(WaitForEvent("done", "chatcmpl-"));
}

TEST_P(OpenAIServiceTest, ModelsHealthMetrics) {
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", http_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto models = (*conn)->Request(
      "GET", "/v1/models", {{"Authorization", "Bearer sekrit"}}, "", absl::Seconds(10));
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->status_code, 200) << models->body;
  json m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "kimi-k3");
  EXPECT_EQ(m["data"][0]["object"], "model");

  auto health = (*conn)->Get("/health", absl::Seconds(10));  // no key needed
  ASSERT_TRUE(health.ok());
  // The fixture server has no health service registered: NOT_FOUND → 503.
  EXPECT_EQ(health->status_code, 503) << health->body;

  auto metrics = (*conn)->Get("/metrics", absl::Seconds(10));
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(metrics->status_code, 200);
  EXPECT_NE(metrics->body.find(
                "tandem_gateway_requests_total{endpoint=\"models\",status=\"200\"} 1"),
            std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("tandem_gateway_active_streams"), std::string::npos);
}

// What a client reconstructs from one streamed response (choice 0), and the
// order invariants every stream must keep.
struct Streamed {
  std::string reasoning, content;
  json tool_calls = json::array();  // accumulated by index: id, name, arguments
  json logprobs = json::array();    // chat: content entries; completions: tokens
  std::vector<double> token_logprobs;
  std::vector<size_t> text_offsets;
  std::string finish_reason;
  json usage;
  int chunks = 0;  // chunks carrying output (not role-only, finish or usage)
};

// Parses an SSE body; fails the test when an order invariant is broken: the
// finish chunk is the choice's last, usage follows every choice chunk,
// [DONE] ends the stream, each chunk's logprobs are one per token it ends.
Streamed Collect(const std::string& body, bool chat) {
  Streamed s;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(body, &events);
  EXPECT_FALSE(events.empty());
  if (events.empty()) return s;
  EXPECT_EQ(events.back(), "[DONE]");
  bool finished = false, usage_seen = false;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json e = json::parse(events[i]);
    if (e.contains("usage") && !e["usage"].is_null()) {
      EXPECT_FALSE(usage_seen);
      usage_seen = true;
      s.usage = e["usage"];
      EXPECT_TRUE(e["choices"].empty());
      continue;
    }
    EXPECT_FALSE(usage_seen) << "a chunk after the usage chunk: " << events[i];
    EXPECT_FALSE(finished) << "a chunk after the finish chunk: " << events[i];
    const json& c = e["choices"][0];
    bool output = false;
    if (chat) {
      const json& d = c["delta"];
      if (d.contains("reasoning_content")) {
        s.reasoning += d["reasoning_content"].get<std::string>();
        output = true;
      }
      if (d.contains("content") && !d["content"].get<std::string>().empty()) {
        s.content += d["content"].get<std::string>();
        output = true;
      }
      if (d.contains("tool_calls")) {
        output = true;
        for (const json& t : d["tool_calls"]) {
          const size_t index = t["index"].get<size_t>();
          while (s.tool_calls.size() <= index) {
            s.tool_calls.push_back({{"id", ""}, {"name", ""}, {"arguments", ""}});
          }
          json& acc = s.tool_calls[index];
          if (t.contains("id")) acc["id"] = t["id"];
          if (t.contains("function") && t["function"].contains("name")) {
            acc["name"] = t["function"]["name"];
          }
          acc["arguments"] = acc["arguments"].get<std::string>() +
                             t["function"]["arguments"].get<std::string>();
        }
      }
      if (!c["logprobs"].is_null()) {
        for (const json& lp : c["logprobs"]["content"]) s.logprobs.push_back(lp);
      }
    } else {
      const std::string text = c["text"].get<std::string>();
      if (!text.empty()) output = true;
      // The chunk's tokens start where the text so far ends (no stop string
      // held anything back in these requests) and cover its text.
      if (!c["logprobs"].is_null()) {
        const json& lp = c["logprobs"];
        EXPECT_EQ(lp["tokens"].size(), lp["token_logprobs"].size());
        EXPECT_EQ(lp["tokens"].size(), lp["text_offset"].size());
        for (size_t k = 0; k < lp["tokens"].size(); ++k) {
          s.logprobs.push_back(lp["tokens"][k]);
          s.token_logprobs.push_back(lp["token_logprobs"][k].get<double>());
          s.text_offsets.push_back(lp["text_offset"][k].get<size_t>());
        }
      }
      s.content += text;
    }
    if (output) ++s.chunks;
    if (!c["finish_reason"].is_null()) {
      finished = true;
      s.finish_reason = c["finish_reason"];
      EXPECT_FALSE(output) << "the finish chunk carries output: " << events[i];
    }
  }
  EXPECT_TRUE(finished);
  return s;
}

// The router may send several tokens per message (coalesced behind a slow
// write, or a speculative step). A client must see the same choice token for
// token: the same text, reasoning, tool calls, logprobs (one per token, in
// order), finish reason and usage, in fewer chunks, finish and usage last.
TEST_P(OpenAIServiceTest, MultiTokenMessagesStreamTheSameChoice) {
  struct Case {
    const char* name;
    std::string path;
    json body;  // its prompt / last message gets the "#per_message:K" tag
  };
  const std::vector<Case> cases = {
      {"chat, thinking, logprobs", "/v1/chat/completions",
       ChatBody("Hi", {{"stream", true},
                       {"logprobs", true},
                       {"top_logprobs", 2},
                       {"seed", 5},
                       {"stream_options", {{"include_usage", true}}}})},
      {"chat, tool call", "/v1/chat/completions",
       ChatBody("Weather? #tool",
                {{"stream", true},
                 {"stream_options", {{"include_usage", true}}},
                 {"tools",
                  json::array(
                      {{{"type", "function"},
                        {"function",
                         {{"name", "get_weather"},
                          {"parameters",
                           {{"type", "object"},
                            {"properties", {{"city", {{"type", "string"}}}}}}}}}}})}})},
      {"completions, logprobs", "/v1/completions",
       json{{"model", "kimi-k3"},
            {"prompt", "Say something"},
            {"stream", true},
            {"logprobs", 2},
            {"stream_options", {{"include_usage", true}}}}},
      {"completions, max_tokens", "/v1/completions",
       json{{"model", "kimi-k3"},
            {"prompt", "Say something"},
            {"stream", true},
            {"max_tokens", 7},
            {"stream_options", {{"include_usage", true}}}}},
  };
  for (const Case& c : cases) {
    const bool chat = c.path == "/v1/chat/completions";
    std::vector<Streamed> runs;
    for (int k : {1, 3, 64}) {
      json body = c.body;
      const std::string tag = absl::StrCat(" #per_message:", k);
      if (chat) {
        body["messages"].back()["content"] =
            body["messages"].back()["content"].get<std::string>() + tag;
      } else {
        body["prompt"] = body["prompt"].get<std::string>() + tag;
      }
      auto r = Post(c.path, body);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->status_code, 200) << r->body;
      runs.push_back(Collect(r->body, chat));
    }
    const Streamed& one = runs[0];
    EXPECT_FALSE(one.content.empty() && one.tool_calls.empty()) << c.name;
    for (size_t j = 1; j < runs.size(); ++j) {
      const Streamed& many = runs[j];
      SCOPED_TRACE(absl::StrCat(c.name, ", run ", j));
      EXPECT_EQ(many.reasoning, one.reasoning);
      EXPECT_EQ(many.content, one.content);
      // Tool call ids are fresh per request: compare the rest, and the shape.
      ASSERT_EQ(many.tool_calls.size(), one.tool_calls.size());
      for (size_t t = 0; t < one.tool_calls.size(); ++t) {
        EXPECT_EQ(many.tool_calls[t]["name"], one.tool_calls[t]["name"]);
        EXPECT_EQ(many.tool_calls[t]["arguments"], one.tool_calls[t]["arguments"]);
        EXPECT_EQ(many.tool_calls[t]["id"].get<std::string>().rfind("call_", 0), 0u);
      }
      EXPECT_EQ(many.logprobs, one.logprobs);
      EXPECT_EQ(many.token_logprobs, one.token_logprobs);
      EXPECT_EQ(many.text_offsets, one.text_offsets);
      EXPECT_EQ(many.finish_reason, one.finish_reason);
      EXPECT_EQ(many.usage["completion_tokens"], one.usage["completion_tokens"]);
      EXPECT_EQ(many.usage["total_tokens"].get<int>() -
                    many.usage["prompt_tokens"].get<int>(),
                many.usage["completion_tokens"].get<int>());
      if (GetParam().sessions == 0 && GetParam().stream_interval == 1) {
        // One call per choice keeps the fixture's message boundaries: the
        // multi-token messages make fewer chunks.
        EXPECT_LT(many.chunks, one.chunks);
      } else if (j + 1 == runs.size()) {
        // A session merges whatever queues behind a write, the one-token
        // messages too; 64 tokens per message must share chunks.
        EXPECT_LT(many.chunks, many.usage["completion_tokens"].get<int>());
      }
    }
    // One logprob entry per generated token (completions; chat streams show
    // the tokens with visible output).
    if (!chat && c.body.contains("logprobs")) {
      EXPECT_EQ(static_cast<int>(one.logprobs.size()),
                one.usage["completion_tokens"].get<int>())
          << c.name;
    }
    if (!chat && !one.text_offsets.empty()) {
      // Offsets index the text: each token's text starts at its offset.
      for (size_t k = 0; k < one.text_offsets.size(); ++k) {
        const std::string token = one.logprobs[k].get<std::string>();
        if (one.text_offsets[k] + token.size() <= one.content.size()) {
          EXPECT_EQ(one.content.substr(one.text_offsets[k], token.size()), token);
        }
      }
    }
  }
}

// A stop string whose tokens arrive in one message (and one that straddles
// two messages) ends the choice exactly where it does one token at a time:
// same text, same completion_tokens, finish "stop" last.
TEST_P(OpenAIServiceTest, StopStringsSpanningMergedTokens) {
  for (const char* stop : {"brown fox", "fox jumps over", "The end"}) {
    std::vector<Streamed> runs;
    for (int k : {1, 2, 5, 64}) {
      auto r = Post("/v1/completions",
                    json{{"model", "kimi-k3"},
                         {"prompt", absl::StrCat("Say something #per_message:", k)},
                         {"stream", true},
                         {"stop", {stop}},
                         {"logprobs", 0},
                         {"stream_options", {{"include_usage", true}}}});
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->status_code, 200) << r->body;
      runs.push_back(Collect(r->body, /*chat=*/false));
    }
    const std::string full = " The quick brown fox jumps over the lazy dog. The end.";
    EXPECT_EQ(runs[0].content, full.substr(0, full.find(stop))) << stop;
    for (const Streamed& s : runs) {
      SCOPED_TRACE(stop);
      EXPECT_EQ(s.content, runs[0].content);
      EXPECT_EQ(s.finish_reason, "stop");
      EXPECT_EQ(s.usage["completion_tokens"], runs[0].usage["completion_tokens"]);
      EXPECT_EQ(s.logprobs, runs[0].logprobs);
      EXPECT_EQ(static_cast<int>(s.logprobs.size()),
                s.usage["completion_tokens"].get<int>());
    }
  }
}

}  // namespace
}  // namespace tandem::gateway
