// TEST FIXTURE ONLY: runs ScriptedRouter (scripted_router.h) as a process for
// the gateway's end-to-end test. Prints one JSON line per event on stdout,
// starting with {"event":"listening","port":N}.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cstdio>
#include <mutex>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "common/init.h"
#include "common/signals.h"
#include "gateway/testing/scripted_router.h"

ABSL_FLAG(std::string, model, "", "Tokenizer directory.");
ABSL_FLAG(int, port, 0, "gRPC port on 127.0.0.1 (0: any free one).");
ABSL_FLAG(int64_t, max_context_tokens, 4096, "Context limit reported by ListModels.");
ABSL_FLAG(double, step_ms, 0,
          "Step clock period of \"#paced\" requests (0: none; see scripted_router.h).");
ABSL_FLAG(bool, quiet, false, "Print only the listening event (benchmarks).");

int main(int argc, char** argv) {
  tandem::BlockTerminationSignals();
  tandem::InitProgram(argc, argv, "scripted-router",
                      "Test fixture: a Router that streams scripted tokens.");
  // A stand-in for the router in benchmarks: no Abseil mutex deadlock
  // detection (a debugging aid Debian's build leaves on).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto tokenizer = tandem::tokenizer::Tokenizer::Load(absl::GetFlag(FLAGS_model));
  if (!tokenizer.ok()) {
    fprintf(stderr, "scripted_router: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  std::mutex out_mu;
  const bool quiet = absl::GetFlag(FLAGS_quiet);
  auto emit = [&out_mu, quiet](const nlohmann::json& event) {
    if (quiet && event["event"] != "listening") return;
    std::lock_guard<std::mutex> lock(out_mu);
    fprintf(stdout, "%s\n", event.dump().c_str());
    fflush(stdout);
  };
  tandem::gateway::testing::ScriptedRouter router(
      tokenizer->get(),
      {.max_context_tokens = absl::GetFlag(FLAGS_max_context_tokens),
       .step = absl::Milliseconds(absl::GetFlag(FLAGS_step_ms))},
      emit);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&router);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    fprintf(stderr, "scripted_router: cannot listen\n");
    return 1;
  }
  emit({{"event", "listening"}, {"port", port}});
  // Paced streams may still be open when asked to stop (a benchmark that
  // ends): Shutdown cancels them, then the router's step clock stops.
  tandem::WaitForTerminationSignal();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
