#include "common/tls/tls_credentials.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"

namespace tandem::tls {
namespace {

namespace fs = std::filesystem;

// A throw-away PKI made with the openssl command line: CAs, and certificates
// signed by them with the given subjectAltName.
class Pki {
 public:
  Pki() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ =
        fs::path(tmp != nullptr ? tmp : "/tmp") /
        absl::StrCat("tls_test_",
                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Pki() { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  void Ca(const std::string& name) {
    Run(absl::StrCat(
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes",
        " -keyout ", Path(name + ".key"), " -out ", Path(name + ".crt"),
        " -days 2 -subj /CN=", name));
  }

  // name.crt / name.key signed by ca, with subjectAltName san.
  void Cert(const std::string& name, const std::string& ca, const std::string& san) {
    Run(absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes",
                     " -keyout ", Path(name + ".key"), " -out ", Path(name + ".csr"),
                     " -subj /CN=", name));
    {
      std::ofstream ext(Path(name + ".ext"));
      ext << "subjectAltName=" << san << "\nextendedKeyUsage=serverAuth,clientAuth\n";
    }
    Run(absl::StrCat("openssl x509 -req -in ", Path(name + ".csr"), " -CA ",
                     Path(ca + ".crt"), " -CAkey ", Path(ca + ".key"),
                     " -CAcreateserial -days 2 -out ", Path(name + ".crt"),
                     " -extfile ", Path(name + ".ext")));
  }

  TlsFiles Files(const std::string& ca, const std::string& name) const {
    return {Path(ca + ".crt"), Path(name + ".crt"), Path(name + ".key")};
  }

 private:
  static void Run(const std::string& cmd) {
    const std::string quiet = cmd + " >/dev/null 2>&1";
    ASSERT_EQ(std::system(quiet.c_str()), 0) << cmd;
  }
  fs::path dir_;
};

// Answers every health Check SERVING.
class ServingHealth final : public grpc::health::v1::Health::Service {
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* resp) override {
    resp->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
};

// A gRPC server with only the health service, on 127.0.0.1:0.
class HealthServer {
 public:
  explicit HealthServer(std::shared_ptr<grpc::ServerCredentials> creds) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", std::move(creds), &port_);
    b.RegisterService(&health_);
    server_ = b.BuildAndStart();
  }
  ~HealthServer() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  bool started() const { return server_ != nullptr && port_ != 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  ServingHealth health_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// One health Check on a fresh connection (its own subchannel: a new handshake).
grpc::Status Check(const std::string& target,
                   const std::shared_ptr<grpc::ChannelCredentials>& creds) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(target, creds, args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp);
}

class TlsCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pki_.Ca("ca");
    pki_.Ca("other-ca");
    pki_.Cert("server", "ca", "DNS:localhost,IP:127.0.0.1");
    pki_.Cert("client", "ca", "DNS:client");
    pki_.Cert("stranger", "other-ca", "DNS:stranger");
  }
  TlsOptions Options(const std::string& ca, const std::string& name) const {
    TlsOptions o;
    o.files = pki_.Files(ca, name);
    o.refresh = absl::Seconds(1);
    return o;
  }
  Pki pki_;
};

TEST_F(TlsCredentialsTest, CheckFilesAcceptsAMatchingSet) {
  EXPECT_TRUE(CheckFiles(pki_.Files("ca", "server")).ok());
}

TEST_F(TlsCredentialsTest, CheckFilesNamesWhatIsWrong) {
  TlsFiles missing = pki_.Files("ca", "server");
  missing.cert = pki_.Path("absent.crt");
  absl::Status s = CheckFiles(missing);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("absent.crt"), std::string::npos) << s;

  TlsFiles wrong_key = pki_.Files("ca", "server");
  wrong_key.key = pki_.Path("client.key");
  s = CheckFiles(wrong_key);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("is not the key"), std::string::npos) << s;

  TlsFiles not_pem = pki_.Files("ca", "server");
  not_pem.ca = pki_.Path("server.ext");
  s = CheckFiles(not_pem);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no PEM certificate"), std::string::npos) << s;

  TlsFiles key_is_cert = pki_.Files("ca", "server");
  key_is_cert.key = pki_.Path("server.crt");
  EXPECT_EQ(CheckFiles(key_is_cert).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_FALSE(MakeServerCredentials({.files = missing}).ok());
  EXPECT_FALSE(MakeChannelCredentials({.files = wrong_key}).ok());
  EXPECT_FALSE(MakeStaticServerCredentials(not_pem, true).ok());
  EXPECT_FALSE(MakeStaticChannelCredentials(missing).ok());
}

TEST_F(TlsCredentialsTest, MutualTlsAdmitsOnlyClientsWithACertificateFromTheCa) {
  auto server_creds = MakeServerCredentials(Options("ca", "server"));
  ASSERT_TRUE(server_creds.ok()) << server_creds.status();
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());

  auto good = MakeChannelCredentials(Options("ca", "client"));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(Check(server.address(), *good).ok());

  // No client certificate: the server's CA as trust, nothing to present.
  grpc::SslCredentialsOptions no_cert;
  std::ifstream ca(pki_.Path("ca.crt"));
  no_cert.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
  EXPECT_FALSE(Check(server.address(), grpc::SslCredentials(no_cert)).ok());

  // A certificate from another CA (trusting the server's CA, so only the client
  // side is wrong).
  TlsOptions stranger = Options("ca", "stranger");
  auto wrong = MakeChannelCredentials(stranger);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_FALSE(Check(server.address(), *wrong).ok());

  // Plaintext.
  EXPECT_FALSE(Check(server.address(), grpc::InsecureChannelCredentials()).ok());
}

TEST_F(TlsCredentialsTest, ClientRefusesAServerFromAnotherCa) {
  pki_.Cert("rogue-server", "other-ca", "DNS:localhost,IP:127.0.0.1");
  TlsOptions server_options = Options("ca", "rogue-server");  // verifies clients by ca
  auto server_creds = MakeServerCredentials(server_options);
  ASSERT_TRUE(server_creds.ok()) << server_creds.status();
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());
  auto client = MakeChannelCredentials(Options("ca", "client"));
  ASSERT_TRUE(client.ok());
  EXPECT_FALSE(Check(server.address(), *client).ok());
}

TEST_F(TlsCredentialsTest, ServerNameCheckCanBeLimitedToTheChain) {
  // A server certificate naming a Service, dialled by IP (as peers dial pod IPs).
  pki_.Cert("named-server", "ca", "DNS:tandem-router");
  auto server_creds = MakeServerCredentials(Options("ca", "named-server"));
  ASSERT_TRUE(server_creds.ok());
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());
  auto strict = MakeChannelCredentials(Options("ca", "client"));
  ASSERT_TRUE(strict.ok());
  EXPECT_FALSE(Check(server.address(), *strict).ok());
  TlsOptions chain_only = Options("ca", "client");
  chain_only.verify_server_name = false;
  auto lax = MakeChannelCredentials(chain_only);
  ASSERT_TRUE(lax.ok());
  EXPECT_TRUE(Check(server.address(), *lax).ok());
}

TEST_F(TlsCredentialsTest, OptionalClientCertificate) {
  TlsOptions o = Options("ca", "server");
  o.require_client_cert = false;
  auto server_creds = MakeServerCredentials(o);
  ASSERT_TRUE(server_creds.ok());
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());
  grpc::SslCredentialsOptions no_cert;
  std::ifstream ca(pki_.Path("ca.crt"));
  no_cert.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
  EXPECT_TRUE(Check(server.address(), grpc::SslCredentials(no_cert)).ok());
}

TEST_F(TlsCredentialsTest, StaticCredentialsDoMutualTls) {
  auto server_creds = MakeStaticServerCredentials(pki_.Files("ca", "server"), true);
  ASSERT_TRUE(server_creds.ok()) << server_creds.status();
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());
  auto good = MakeStaticChannelCredentials(pki_.Files("ca", "client"));
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(Check(server.address(), *good).ok());
  auto wrong = MakeStaticChannelCredentials(pki_.Files("ca", "stranger"));
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(Check(server.address(), *wrong).ok());
}

// The server's files are replaced (a rotated Secret): a new CA and a server
// certificate from it. New handshakes use them within the refresh interval: a
// client of the new CA gets in, one of the old CA no longer does.
TEST_F(TlsCredentialsTest, ServerReloadsRotatedFiles) {
  pki_.Cert("server2", "other-ca", "DNS:localhost,IP:127.0.0.1");
  pki_.Cert("client2", "other-ca", "DNS:client2");
  const std::string live = pki_.Path("live");
  fs::create_directories(live);
  auto put = [&](const std::string& ca, const std::string& name) {
    // Written beside, then renamed over: as the kubelet swaps a Secret's files.
    for (auto [from, to] :
         {std::pair{ca + ".crt", "ca.crt"}, std::pair{name + ".crt", "tls.crt"},
          std::pair{name + ".key", "tls.key"}}) {
      fs::copy_file(pki_.Path(from), live + "/" + to + ".new",
                    fs::copy_options::overwrite_existing);
      fs::rename(live + "/" + to + ".new", live + "/" + to);
    }
  };
  put("ca", "server");
  TlsOptions o;
  o.files = {live + "/ca.crt", live + "/tls.crt", live + "/tls.key"};
  o.refresh = absl::Seconds(1);
  auto server_creds = MakeServerCredentials(o);
  ASSERT_TRUE(server_creds.ok()) << server_creds.status();
  HealthServer server(*server_creds);
  ASSERT_TRUE(server.started());

  auto old_client = MakeStaticChannelCredentials(pki_.Files("ca", "client"));
  auto new_client = MakeStaticChannelCredentials(pki_.Files("other-ca", "client2"));
  ASSERT_TRUE(old_client.ok() && new_client.ok());
  ASSERT_TRUE(Check(server.address(), *old_client).ok());
  ASSERT_FALSE(Check(server.address(), *new_client).ok());

  put("other-ca", "server2");
  // The watcher re-reads every second; allow a few.
  bool switched = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (!switched && std::chrono::steady_clock::now() < until) {
    switched = Check(server.address(), *new_client).ok();
    // Polling the watcher, not synchronising: spare the shared cores.
    if (!switched) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(switched) << "the server did not pick up the rotated files";
  EXPECT_FALSE(Check(server.address(), *old_client).ok());
}

}  // namespace
}  // namespace tandem::tls
