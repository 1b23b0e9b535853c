// mTLS between every process (issue 18, item 4): router, prefill and decode
// workers and the gateway started with --tls_ca/--tls_cert/--tls_key from a
// throw-away PKI (tools/tls_pki.sh) serve a request, over gRPC and through the
// gateway; a client without a certificate or with one from another CA cannot
// call the router or a worker; a worker without a certificate, or with one from
// another CA, cannot register (it says so in its log) and so gets no requests.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/tls/tls_flags.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "proto/health.grpc.pb.h"
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"
#include "tests/testing/subprocess.h"

namespace tandem::testing {
namespace {

std::string Tmp() { return std::getenv("TEST_TMPDIR"); }

void MakePki(const std::string& dir, const std::vector<std::string>& names) {
  std::string cmd = RunfilePath("tools/tls_pki.sh") + " " + dir;
  for (const std::string& n : names) cmd += " " + n;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

std::vector<std::string> TlsFlags(const std::string& dir, const std::string& name) {
  return {"--tls_ca=" + dir + "/ca.crt", "--tls_cert=" + dir + "/" + name + ".crt",
          "--tls_key=" + dir + "/" + name + ".key"};
}

std::shared_ptr<grpc::ChannelCredentials> Client(const std::string& dir,
                                                 const std::string& name) {
  auto c = tls::MakeGrpcCredentials(
      {dir + "/ca.crt", dir + "/" + name + ".crt", dir + "/" + name + ".key"},
      absl::Seconds(60));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? c->channel : nullptr;
}

// Health Check on 127.0.0.1:port with `creds`, 5 s deadline.
grpc::Status Health(int port, std::shared_ptr<grpc::ChannelCredentials> creds) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), std::move(creds)));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp);
}

// The cluster, started once for the suite (model loads dominate the time).
struct TlsCluster {
  std::string pki, other_pki;
  std::unique_ptr<Subprocess> router, prefill, decode, gateway;
  int router_port = 0, router_metrics = 0, decode_port = 0, gateway_port = 0;
  std::string error;  // empty when up

  std::unique_ptr<Subprocess> StartWorker(const std::string& role,
                                          const std::string& id,
                                          const std::vector<std::string>& tls) {
    std::vector<std::string> argv = {RunfilePath(role + "/" + role + "_main"),
                                     std::string("--model=") + kTinyModel,
                                     "--worker_id=" + id,
                                     absl::StrCat("--router=127.0.0.1:", router_port),
                                     "--port=0",
                                     "--metrics_port=0",
                                     "--max_num_seqs=4",
                                     "--max_model_len=512",
                                     "--kv_cache_memory=64MiB",
                                     "--log_format=json"};
    argv.insert(argv.end(), tls.begin(), tls.end());
    auto w = Subprocess::Start(argv, Tmp() + "/" + id + ".log");
    if (!w.ok()) {
      error = std::string(w.status().message());
      return nullptr;
    }
    return std::make_unique<Subprocess>(std::move(*w));
  }

  std::string Logs() const {
    std::string out;
    for (const auto* p : {&router, &prefill, &decode, &gateway}) {
      if (*p) out += "---\n" + (*p)->ReadLog();
    }
    return out;
  }

  void Start() {
    pki = Tmp() + "/pki";
    other_pki = Tmp() + "/other_pki";
    MakePki(pki, {"router", "prefill", "decode", "gateway", "client"});
    MakePki(other_pki, {"rogue", "client"});
    // --colocate_below_tokens=0: disaggregated (the 24-token prompts are below
    // the router's default, 1000): the router's mTLS channel to the prefill
    // worker is part of what is tested.
    std::vector<std::string> argv = {RunfilePath("router/router_main"),
                                     std::string("--model=") + kTinyModel,
                                     "--port=0",
                                     "--metrics_port=0",
                                     "--heartbeat_interval_s=0.2",
                                     "--heartbeat_timeout_s=30",
                                     "--colocate_below_tokens=0",
                                     "--log_format=json"};
    for (const std::string& f : TlsFlags(pki, "router")) argv.push_back(f);
    auto r = Subprocess::Start(argv, Tmp() + "/router.log");
    if (!r.ok()) {
      error = std::string(r.status().message());
      return;
    }
    router = std::make_unique<Subprocess>(std::move(*r));
    router_port = LoggedPort(*router, "router serving", "grpc_port");
    router_metrics = LoggedPort(*router, "router serving", "metrics_port");
    if (router_port == 0) {
      error = "router did not log its port\n" + Logs();
      return;
    }
    prefill = StartWorker("prefill", "prefill", TlsFlags(pki, "prefill"));
    decode = StartWorker("decode", "decode", TlsFlags(pki, "decode"));
    if (!prefill || !decode) return;
    decode_port = LoggedPort(*decode, "worker serving", "grpc_port");
    for (const char* role : {"prefill", "decode"}) {
      if (!WaitMetric(router_metrics, "tandem_router_workers", {{"role", role}}, 1)) {
        error = std::string(role) + " did not register over mTLS\n" + Logs();
        return;
      }
    }
    std::vector<std::string> gargv = {RunfilePath("gateway/gateway_main"),
                                      std::string("--model=") + kTinyModel,
                                      absl::StrCat("--router=127.0.0.1:", router_port),
                                      "--port=0", "--log_format=json"};
    for (const std::string& f : TlsFlags(pki, "gateway")) gargv.push_back(f);
    // HTTPS at the edge, with the gateway's certificate from the same CA.
    gargv.push_back("--ssl_certfile=" + pki + "/gateway.crt");
    gargv.push_back("--ssl_keyfile=" + pki + "/gateway.key");
    auto g = Subprocess::Start(gargv, Tmp() + "/gateway.log");
    if (!g.ok()) {
      error = std::string(g.status().message());
      return;
    }
    gateway = std::make_unique<Subprocess>(std::move(*g));
    gateway_port = LoggedPort(*gateway, "gateway serving", "port");
    if (gateway_port == 0) error = "gateway did not log its port\n" + Logs();
  }
};

class ClusterTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new TlsCluster();
    cluster_->Start();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(cluster_->error, "") << cluster_->error; }

  static StreamResult Generate(std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = tandem::v1::Router::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", cluster_->router_port), std::move(creds)));
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return Drain(stub->Generate(&ctx, MakeRequest(24, 7, 4, 0)).get());
  }

  static TlsCluster* cluster_;
};

TlsCluster* ClusterTlsTest::cluster_ = nullptr;

TEST_F(ClusterTlsTest, ClientWithCertificateIsServed) {
  StreamResult r = Generate(Client(cluster_->pki, "client"));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster_->Logs();
  EXPECT_EQ(r.tokens.size(), 4u);
}

// What `cmd` prints on stdout, and its exit status.
std::pair<std::string, int> Output(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {"", -1};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  return {out, pclose(p)};
}

// The gateway serves HTTPS (--ssl_certfile/--ssl_keyfile) to an OpenAI client
// that trusts the CA, and reaches the router over mTLS; plain HTTP on that port
// gets no answer.
TEST_F(ClusterTlsTest, GatewayServesHttpsAndReachesTheRouterOverMtls) {
  const std::string url =
      absl::StrCat("127.0.0.1:", cluster_->gateway_port, "/v1/completions");
  const std::string body =
      R"({"model": "kimi-k3", "prompt": "Hello", "max_tokens": 4})";
  auto [out, rc] =
      Output(absl::StrCat("curl -sS --max-time 60 --cacert ", cluster_->pki,
                          "/ca.crt -H 'content-type: "
                          "application/json' -d '",
                          body, "' -w '\\n%{http_code}' https://", url, " 2>&1"));
  ASSERT_EQ(rc, 0) << out << "\n" << cluster_->Logs();
  EXPECT_NE(out.find("\"completion_tokens\":"), std::string::npos) << out;
  EXPECT_EQ(out.substr(out.size() - 3), "200") << out;
  auto [plain, plain_rc] = Output(
      absl::StrCat("curl -sS --max-time 10 -d '", body, "' http://", url, " 2>&1"));
  EXPECT_NE(plain_rc, 0) << plain;
  EXPECT_EQ(plain.find("completion_tokens"), std::string::npos) << plain;
}

TEST_F(ClusterTlsTest, ClientWithoutCertificateIsRefused) {
  StreamResult plain = Generate(grpc::InsecureChannelCredentials());
  EXPECT_EQ(plain.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << plain.status.error_message();
  EXPECT_TRUE(plain.tokens.empty());
  // TLS, the right CA, but no client certificate.
  grpc::SslCredentialsOptions no_cert;
  {
    std::ifstream in(cluster_->pki + "/ca.crt");
    std::ostringstream pem;
    pem << in.rdbuf();
    no_cert.pem_root_certs = pem.str();
    ASSERT_FALSE(no_cert.pem_root_certs.empty());
  }
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  auto stub = tandem::v1::Router::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", cluster_->router_port),
                                grpc::SslCredentials(no_cert), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  StreamResult r = Drain(stub->Generate(&ctx, MakeRequest(24, 7, 4, 0)).get());
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(r.tokens.empty());
  // Workers refuse such clients too.
  EXPECT_FALSE(Health(cluster_->decode_port, grpc::InsecureChannelCredentials()).ok());
  EXPECT_TRUE(Health(cluster_->decode_port, Client(cluster_->pki, "client")).ok());
}

TEST_F(ClusterTlsTest, ClientFromAnotherCaIsRefused) {
  StreamResult r = Generate(Client(cluster_->other_pki, "client"));
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(r.tokens.empty());
  // Trusting the cluster's CA but presenting another CA's certificate: the
  // router itself refuses the handshake.
  auto mixed = tls::MakeGrpcCredentials(
      {cluster_->pki + "/ca.crt", cluster_->other_pki + "/client.crt",
       cluster_->other_pki + "/client.key"},
      absl::Seconds(60));
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  StreamResult m = Generate(mixed->channel);
  EXPECT_FALSE(m.status.ok());
  EXPECT_TRUE(m.tokens.empty());
  EXPECT_NE(cluster_->router->ReadLog().find("certificate verify failed"),
            std::string::npos);
  EXPECT_FALSE(
      Health(cluster_->decode_port, Client(cluster_->other_pki, "client")).ok());
}

// A worker that cannot register: it logs why (bounded wait), never registers,
// and the router still counts only the decode worker with a valid certificate,
// so no request can reach it.
void ExpectCannotRegister(Subprocess* w, int router_metrics) {
  const absl::Time end = absl::Now() + absl::Seconds(90);
  std::string log;
  while (absl::Now() < end) {
    log = w->ReadLog();
    if (log.find("cannot register with the router") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(log.find("cannot register with the router"), std::string::npos) << log;
  EXPECT_NE(log.find("\"code\":14"), std::string::npos) << log;  // UNAVAILABLE
  EXPECT_EQ(log.find("registered with the router"), std::string::npos) << log;
  auto n = Metric(router_metrics, "tandem_router_workers", {{"role", "decode"}});
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1);
}

TEST_F(ClusterTlsTest, WorkerWithoutCertificateCannotRegister) {
  auto w = cluster_->StartWorker("decode", "rogue-plain", {});
  ASSERT_NE(w, nullptr) << cluster_->error;
  ExpectCannotRegister(w.get(), cluster_->router_metrics);
}

TEST_F(ClusterTlsTest, WorkerFromAnotherCaCannotRegister) {
  auto w = cluster_->StartWorker("decode", "rogue-ca",
                                 TlsFlags(cluster_->other_pki, "rogue"));
  ASSERT_NE(w, nullptr) << cluster_->error;
  ExpectCannotRegister(w.get(), cluster_->router_metrics);
  // Trusting the cluster's CA, its own certificate from another: the router
  // refuses it.
  auto m = cluster_->StartWorker("decode", "rogue-mixed",
                                 {"--tls_ca=" + cluster_->pki + "/ca.crt",
                                  "--tls_cert=" + cluster_->other_pki + "/rogue.crt",
                                  "--tls_key=" + cluster_->other_pki + "/rogue.key"});
  ASSERT_NE(m, nullptr) << cluster_->error;
  ExpectCannotRegister(m.get(), cluster_->router_metrics);
  // And the cluster still serves.
  StreamResult r = Generate(Client(cluster_->pki, "client"));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
}

}  // namespace
}  // namespace tandem::testing
