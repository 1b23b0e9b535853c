// A router + one prefill + one decode worker as real processes on localhost
// (tiny checkpoint, every port picked by the kernel), for end-to-end tests, plus
// helpers to read their /metrics and drain Generate streams.
#ifndef TANDEM_TESTS_TESTING_PROCESS_CLUSTER_H_
#define TANDEM_TESTS_TESTING_PROCESS_CLUSTER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/router.grpc.pb.h"
#include "tests/testing/subprocess.h"

namespace tandem::testing {

// Runfiles path of the tiny checkpoint.
inline constexpr char kTinyModel[] = "engine/model/tiny_checkpoint";

// The port a child logged in its "<msg>" line (JSON logs) as `field`, polled
// with a bound; 0 if it never appeared.
int LoggedPort(const Subprocess& proc, const std::string& msg, const std::string& field,
               absl::Duration timeout = absl::Seconds(30));

std::chrono::system_clock::time_point In(int seconds);

// One sample of a /metrics endpoint on 127.0.0.1:port.
absl::StatusOr<double> Metric(int port, const std::string& name,
                              const std::map<std::string, std::string>& labels);

// Polls until the metric equals `want` (bounded: gauges update asynchronously).
bool WaitMetric(int port, const std::string& name,
                const std::map<std::string, std::string>& labels, double want,
                absl::Duration timeout = absl::Seconds(30));

struct StreamResult {
  std::vector<int32_t> tokens;
  grpc::Status status;
  int messages = 0;
  std::string request_id;
  tandem::v1::Usage usage;  // the last message's (the router sets it there)
};

// Reads a Generate stream to its end; `after_message(n)` runs after the n-th.
StreamResult Drain(grpc::ClientReaderInterface<tandem::v1::GenerateResponse>* reader,
                   std::function<void(int)> after_message = nullptr);

// A deterministic prompt of `len` token ids derived from `seed`.
tandem::v1::GenerateRequest MakeRequest(int len, uint64_t seed, int max_tokens,
                                        float temperature);

class ProcessCluster {
 public:
  // Starts the three processes in $TEST_TMPDIR and waits until both workers have
  // registered. Returns "" when up, else what went wrong (with the logs).
  std::string Start(const std::vector<std::string>& router_flags, int decode_slots,
                    const std::vector<std::string>& prefill_flags = {},
                    const std::vector<std::string>& decode_flags = {});

  StreamResult Generate(const tandem::v1::GenerateRequest& req,
                        std::function<void(int)> after_message = nullptr);
  // Generate with a client deadline of `timeout` (Generate's is 60 s).
  StreamResult GenerateWithin(const tandem::v1::GenerateRequest& req,
                              absl::Duration timeout);
  // Every request at once, one client thread each; results in request order.
  std::vector<StreamResult> GenerateAll(
      const std::vector<tandem::v1::GenerateRequest>& reqs);
  std::string Logs() const;

  int router_port() const { return router_port_; }
  int router_metrics() const { return router_metrics_; }
  int decode_metrics() const { return decode_metrics_; }
  int decode_port() const { return decode_port_; }  // the decode worker's gRPC
  int prefill_metrics() const { return prefill_metrics_; }
  Subprocess& decode() { return *decode_; }
  Subprocess& prefill() { return *prefill_; }

 private:
  std::string tmp_;
  int router_port_ = 0, router_metrics_ = 0, decode_metrics_ = 0, prefill_metrics_ = 0,
      decode_port_ = 0;
  std::unique_ptr<Subprocess> router_, prefill_, decode_;
  std::unique_ptr<tandem::v1::Router::Stub> stub_;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_PROCESS_CLUSTER_H_
