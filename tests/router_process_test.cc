// End to end: the router binary as a real process. Health, ListModels, a refused
// Generate with the counter on /metrics, a worker registration, clean SIGTERM.
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "proto/health.grpc.pb.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

// A free TCP port on loopback (bound then released; the router binds it next).
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

TEST(RouterProcessTest, ServesAndShutsDownCleanly) {
  const std::string tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::create_directories(tmp + "/model");
  std::ofstream(tmp + "/model/config.json")
      << R"({"model_type": "kimi_k3", "eos_token_id": 163586, "text_config":
            {"vocab_size": 163840, "max_position_embeddings": 8192}})";
  const int grpc_port = FreePort(), metrics_port = FreePort();
  auto proc = testing::Subprocess::Start(
      {testing::RunfilePath("router/router_main"), "--model=" + tmp + "/model",
       "--port=" + std::to_string(grpc_port),
       "--metrics_port=" + std::to_string(metrics_port), "--log_format=json"},
      tmp + "/router.log");
  ASSERT_TRUE(proc.ok()) << proc.status();

  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(In(30))) << proc->ReadLog();
  {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, {}, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  auto router = tandem::v1::Router::NewStub(channel);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    tandem::v1::ListModelsResponse resp;
    ASSERT_TRUE(router->ListModels(&ctx, {}, &resp).ok());
    ASSERT_EQ(resp.models_size(), 1);
    EXPECT_EQ(resp.models(0).id(), "kimi-k3");
    EXPECT_EQ(resp.models(0).max_context_tokens(), 8192);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    tandem::v1::GenerateRequest req;
    req.mutable_prompt_token_ids()->add_ids(1);
    auto reader = router->Generate(&ctx, req);
    tandem::v1::GenerateResponse resp;
    EXPECT_FALSE(reader->Read(&resp));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(s.error_message().find("no decode workers"), std::string::npos);
  }
  {
    auto get =
        metrics::HttpGet("127.0.0.1", metrics_port, "/metrics", absl::Seconds(10));
    ASSERT_TRUE(get.ok()) << get.status();
    EXPECT_EQ(get->status_code, 200);
    auto parsed = metrics::ParseText(get->body);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    auto unavailable =
        parsed->Value("tandem_router_requests_total", {{"outcome", "unavailable"}});
    ASSERT_TRUE(unavailable.ok()) << get->body;
    EXPECT_EQ(*unavailable, 1);
    EXPECT_EQ(*parsed->Value("tandem_router_workers", {{"role", "decode"}}), 0);
  }
  {
    // A second router on the same gRPC port (its own metrics port) fails to
    // listen and exits, instead of sharing the port (gRPC's SO_REUSEPORT).
    auto second = testing::Subprocess::Start(
        {testing::RunfilePath("router/router_main"), "--model=" + tmp + "/model",
         "--port=" + std::to_string(grpc_port), "--metrics_port=0"},
        tmp + "/router_second.log");
    ASSERT_TRUE(second.ok()) << second.status();
    auto st = second->Wait(absl::Seconds(30));
    ASSERT_TRUE(st.ok()) << st.status() << second->ReadLog();
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1) << second->ReadLog();
    EXPECT_NE(second->ReadLog().find("cannot listen"), std::string::npos)
        << second->ReadLog();
  }
  proc->Signal(SIGTERM);
  auto st = proc->Wait(absl::Seconds(15));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << proc->ReadLog();
  EXPECT_NE(proc->ReadLog().find("\"msg\":\"shutting down\""), std::string::npos);
}

TEST(RouterProcessTest, MissingModelIsAClearError) {
  const std::string tmp = std::getenv("TEST_TMPDIR");
  auto proc = testing::Subprocess::Start(
      {testing::RunfilePath("router/router_main"), "--model=" + tmp + "/nope",
       "--port=0", "--metrics_port=0"},
      tmp + "/router2.log");
  ASSERT_TRUE(proc.ok());
  auto st = proc->Wait(absl::Seconds(15));
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1);
  EXPECT_NE(proc->ReadLog().find("cannot open"), std::string::npos) << proc->ReadLog();
}

}  // namespace
}  // namespace tandem
