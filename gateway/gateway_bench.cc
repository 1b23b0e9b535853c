// Gateway overhead, measured in one run against the scripted test router
// streaming at full speed (in process, loopback):
//   1. latency: the same request (a prompt that makes the fixture stream
//      --tokens tokens) sent --requests times one after another, directly
//      over gRPC and through the gateway (POST /v1/completions, stream=true,
//      SSE read to [DONE]); p50/p99 of each and the difference (added).
//   2. throughput: --concurrency clients streaming --stream_tokens-token
//      completions for --seconds, directly and through the gateway; tokens/s.
//      Both count the tokens the router sent (direct: token_ids received;
//      gateway: the usage chunk's completion_tokens, stream_options
//      include_usage), so the two figures count the same thing.
// The gateway runs --io_threads I/O threads (default 2: "on 2 cores").
// Ends with one JSON line {"bench":"gateway",...}.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/http_server.h"
#include "gateway/openai_service.h"
#include "gateway/router_client.h"
#include "gateway/sse.h"
#include "gateway/testing/scripted_router.h"
#include "metrics/http_get.h"
#include "metrics/registry.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tokenizer_dir, "", "Tokenizer directory (default: runfiles).");
ABSL_FLAG(int, requests, 300, "Sequential requests per path for the latency figures.");
ABSL_FLAG(int, tokens, 32, "Tokens per request for the latency figures.");
ABSL_FLAG(int, concurrency, 16, "Concurrent streams for the throughput figures.");
ABSL_FLAG(int, stream_tokens, 2000, "Tokens per request for the throughput figures.");
ABSL_FLAG(double, seconds, 3, "Duration of each throughput run.");
ABSL_FLAG(int, io_threads, 2, "Gateway I/O threads.");

namespace tandem::gateway {
namespace {

using json = nlohmann::json;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// One direct Generate read to the end; returns tokens received (-1 on error).
int DirectOnce(tandem::v1::Router::Stub* stub, const std::vector<int>& prompt) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  tandem::v1::GenerateRequest req;
  req.set_model("kimi-k3");
  req.mutable_prompt_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse resp;
  int tokens = 0;
  while (reader->Read(&resp)) tokens += resp.token_ids_size();
  return reader->Finish().ok() ? tokens : -1;
}

// One streamed completion through the gateway; returns the tokens it carried
// (the usage chunk's completion_tokens when the body asks for usage, so that
// both paths count the same tokens; else the SSE chunks), -1 on error.
int GatewayOnce(metrics::HttpConnection* conn, const std::string& body) {
  auto r =
      conn->Request("POST", "/v1/completions", {{"Content-Type", "application/json"}},
                    body, absl::Seconds(60));
  if (!r.ok() || r->status_code != 200) return -1;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(r->body, &events);
  if (events.empty() || events.back() != "[DONE]") return -1;
  if (events.size() >= 2 &&
      absl::StrContains(events[events.size() - 2], "\"usage\":{")) {
    json usage = json::parse(events[events.size() - 2], nullptr, false);
    if (usage.is_discarded() || !usage["usage"]["completion_tokens"].is_number())
      return -1;
    return usage["usage"]["completion_tokens"].get<int>();
  }
  return static_cast<int>(events.size()) - 1;  // one chunk per token
}

int Main(int argc, char** argv) {
  std::string dir = absl::GetFlag(FLAGS_tokenizer_dir);
  if (dir.empty())
    dir = std::string(argv[0]) + ".runfiles/tandem/third_party/kimi_k3_tokenizer";
  auto tokenizer = tokenizer::Tokenizer::Load(dir);
  if (!tokenizer.ok()) {
    fprintf(stderr, "gateway_bench: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  testing::ScriptedRouter fixture(tokenizer->get(), {}, nullptr);
  grpc::ServerBuilder builder;
  int grpc_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &grpc_port);
  builder.RegisterService(&fixture);
  auto grpc_server = builder.BuildAndStart();
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port),
                                     grpc::InsecureChannelCredentials());
  auto stub = tandem::v1::Router::NewStub(channel);

  RouterClient client(grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port),
                                          grpc::InsecureChannelCredentials()));
  metrics::Registry registry;
  OpenAIService service({}, tokenizer->get(), &client, &registry);
  HttpServer http(
      {.io_threads = absl::GetFlag(FLAGS_io_threads)},
      [&service](HttpRequest r, std::shared_ptr<ResponseWriter> w) {
        service.Handle(std::move(r), std::move(w));
      },
      &OpenAIService::FormatServerError);
  if (!http.Start().ok()) return 1;

  // `usage`: ask for the usage chunk, whose completion_tokens the throughput
  // run counts (the same tokens the direct run counts).
  auto prompt_for = [&](int n, bool usage) {
    const std::string text = absl::StrCat("Bench #tokens:", n);
    json body = {{"model", "kimi-k3"}, {"prompt", text}, {"stream", true}};
    if (usage) body["stream_options"] = {{"include_usage", true}};
    return std::make_pair(*(*tokenizer)->Encode(text), body.dump());
  };

  // 1. Latency, sequential, interleaved so both paths see the same machine.
  const int n_tokens = absl::GetFlag(FLAGS_tokens);
  auto [ids, body] = prompt_for(n_tokens, /*usage=*/false);
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", http.port(), absl::Seconds(10));
  if (!conn.ok()) return 1;
  for (int i = 0; i < 20; ++i) {  // warm-up
    DirectOnce(stub.get(), ids);
    GatewayOnce(conn->get(), body);
  }
  std::vector<double> direct_ms, gateway_ms;
  int errors = 0;
  for (int i = 0; i < absl::GetFlag(FLAGS_requests); ++i) {
    absl::Time t0 = absl::Now();
    if (DirectOnce(stub.get(), ids) < 0) ++errors;
    absl::Time t1 = absl::Now();
    if (GatewayOnce(conn->get(), body) < 0) ++errors;
    absl::Time t2 = absl::Now();
    direct_ms.push_back(absl::ToDoubleMilliseconds(t1 - t0));
    gateway_ms.push_back(absl::ToDoubleMilliseconds(t2 - t1));
  }

  // 2. Throughput with concurrent streams.
  auto [big_ids, big_body] =
      prompt_for(absl::GetFlag(FLAGS_stream_tokens), /*usage=*/true);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const absl::Duration duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  auto run = [&](bool through_gateway) {
    std::atomic<int64_t> tokens{0};
    std::atomic<int> failures{0};
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    for (int c = 0; c < concurrency; ++c) {
      threads.emplace_back([&] {
        std::unique_ptr<metrics::HttpConnection> http_conn;
        if (through_gateway) {
          auto cc = metrics::HttpConnection::Connect("127.0.0.1", http.port(),
                                                     absl::Seconds(10));
          if (!cc.ok()) {
            failures.fetch_add(1);
            return;
          }
          http_conn = *std::move(cc);
        }
        while (absl::Now() - start < duration) {
          int n = through_gateway ? GatewayOnce(http_conn.get(), big_body)
                                  : DirectOnce(stub.get(), big_ids);
          if (n < 0) {
            failures.fetch_add(1);
          } else {
            tokens.fetch_add(n);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    errors += failures.load();
    return tokens.load() / secs;
  };
  const double direct_tps = run(false);
  const double gateway_tps = run(true);

  json out = {
      {"bench", "gateway"},
      {"io_threads", absl::GetFlag(FLAGS_io_threads)},
      {"latency_tokens_per_request", n_tokens},
      {"requests", absl::GetFlag(FLAGS_requests)},
      {"direct_p50_ms", Percentile(direct_ms, 0.5)},
      {"direct_p99_ms", Percentile(direct_ms, 0.99)},
      {"gateway_p50_ms", Percentile(gateway_ms, 0.5)},
      {"gateway_p99_ms", Percentile(gateway_ms, 0.99)},
      {"added_p50_ms", Percentile(gateway_ms, 0.5) - Percentile(direct_ms, 0.5)},
      {"added_p99_ms", Percentile(gateway_ms, 0.99) - Percentile(direct_ms, 0.99)},
      {"concurrency", concurrency},
      {"stream_tokens_per_request", absl::GetFlag(FLAGS_stream_tokens)},
      {"direct_tokens_per_s", direct_tps},
      {"gateway_sse_tokens_per_s", gateway_tps},
      {"errors", errors},
  };
  fprintf(stderr,
          "latency (%d tokens/request, %d requests): direct p50 %.3f ms p99 %.3f ms; "
          "gateway p50 %.3f ms p99 %.3f ms\n"
          "throughput (%d streams x %d tokens): direct %.0f tokens/s; gateway SSE %.0f "
          "tokens/s\n",
          n_tokens, absl::GetFlag(FLAGS_requests), out["direct_p50_ms"].get<double>(),
          out["direct_p99_ms"].get<double>(), out["gateway_p50_ms"].get<double>(),
          out["gateway_p99_ms"].get<double>(), concurrency,
          absl::GetFlag(FLAGS_stream_tokens), direct_tps, gateway_tps);
  conn->reset();
  http.Shutdown(absl::Seconds(2));
  service.CancelAll(absl::Seconds(5));
  grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  printf("%s\n", out.dump().c_str());
  return errors == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tandem::gateway

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "gateway_bench",
                      "Gateway overhead vs calling the router directly.");
  return tandem::gateway::Main(argc, argv);
}
