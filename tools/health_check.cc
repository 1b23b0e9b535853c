// Waits until a gRPC server reports SERVING on grpc.health.v1, or a deadline passes.
// Used by ./tandem up and by end-to-end tests.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/tls/tls_flags.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "host:port of the gRPC server.");
ABSL_FLAG(std::string, service, "", "Service name to check; empty = the whole server.");
ABSL_FLAG(double, timeout_s, 30, "Give up after this many seconds.");

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "health_check",
                      "Waits for a gRPC server to report SERVING.\n"
                      "usage: health_check --address=HOST:PORT [--timeout_s=30] "
                      "[--tls_ca=F --tls_cert=F --tls_key=F]");
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                                             absl::GetFlag(FLAGS_timeout_s) * 1000));
  // --tls_ca/--tls_cert/--tls_key: check an mTLS server (./tandem up --tls).
  auto creds = tandem::tls::GrpcCredentialsFromFlags();
  if (!creds.ok()) {
    fprintf(stderr, "health_check: %s\n", creds.status().ToString().c_str());
    return 2;
  }
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_address), creds->channel);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  std::string last = "no answer";
  while (std::chrono::system_clock::now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::seconds(2)));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(absl::GetFlag(FLAGS_service));
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = stub->Check(&ctx, req, &resp);
    if (s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return 0;
    }
    last = s.ok() ? "status " + std::to_string(resp.status()) : s.error_message();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // retry pacing
  }
  fprintf(stderr, "health_check: %s not SERVING within %.1fs (%s)\n",
          absl::GetFlag(FLAGS_address).c_str(), absl::GetFlag(FLAGS_timeout_s),
          last.c_str());
  return 1;
}
