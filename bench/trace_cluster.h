// A local Tandem cluster for the trace replayer: one router and N prefill + M decode
// worker processes (binaries from bazel-bin), started on free ports, torn down (and
// killed with the benchmark: PR_SET_PDEATHSIG) when the object goes away.
#ifndef TANDEM_BENCH_TRACE_CLUSTER_H_
#define TANDEM_BENCH_TRACE_CLUSTER_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::bench {

struct ClusterOptions {
  std::string bin_dir;  // holds router/router_main, prefill/..., decode/...
  std::string model;    // checkpoint directory
  std::string log_dir;  // one log file per process
  std::string name;     // log file prefix
  int prefill_workers = 2;
  int decode_workers = 1;
  std::string routing_policy = "cache_aware";
  bool prefix_caching = true;
  int max_num_seqs = 16;
  int max_model_len = 0;  // 0: the worker's own
  std::string kv_cache_memory = "256MiB";
  int router_max_in_flight = 100000;
  absl::Duration start_timeout = absl::Seconds(90);
};

// A child process; its stdout and stderr go to a log file.
class ClusterProcess {
 public:
  ClusterProcess(const std::vector<std::string>& argv, std::string log);
  ~ClusterProcess();  // SIGTERM, then SIGKILL after 2 s
  ClusterProcess(const ClusterProcess&) = delete;
  ClusterProcess& operator=(const ClusterProcess&) = delete;

  bool started() const { return pid_ > 0; }
  // True once the process has exited (it is then reaped).
  bool Exited();
  std::string Log() const;
  // The integer `field` of the first JSON log line whose msg is `msg`; an error at
  // `deadline` or when the process exits first.
  absl::StatusOr<int> LoggedInt(const std::string& msg, const std::string& field,
                                absl::Time deadline);

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string log_;
};

struct WorkerProcess {
  std::string id;    // prefill-0, decode-0, ...
  std::string role;  // prefill or decode
  std::unique_ptr<ClusterProcess> process;
  int grpc_port = 0, metrics_port = 0;
};

class TraceCluster {
 public:
  // Starts every process and waits until all workers registered with the router
  // and a one-token probe request succeeded; the error carries the logs' tails.
  static absl::StatusOr<std::unique_ptr<TraceCluster>> Start(const ClusterOptions& o);

  int router_port() const { return router_port_; }
  int router_metrics_port() const { return router_metrics_port_; }
  const std::vector<WorkerProcess>& workers() const { return workers_; }
  // Each worker's /metrics as name{labels...} text-format samples: name -> value of
  // the unlabelled series (the counters the replayer reads).
  absl::StatusOr<std::map<std::string, double>> ScrapeWorker(
      const WorkerProcess& w, const std::vector<std::string>& names) const;
  // The router's tandem_router_prefill_choices_total by its "reason" label (cache,
  // balance, load), summed over policies.
  absl::StatusOr<std::map<std::string, double>> ScrapeRouterChoices() const;
  std::string LogTails() const;

 private:
  TraceCluster() = default;
  std::unique_ptr<ClusterProcess> router_;
  std::vector<WorkerProcess> workers_;
  int router_port_ = 0, router_metrics_port_ = 0;
};

}  // namespace tandem::bench

#endif  // TANDEM_BENCH_TRACE_CLUSTER_H_
