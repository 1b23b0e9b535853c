#include "bench/trace_cluster.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "proto/router.grpc.pb.h"

namespace tandem::bench {

ClusterProcess::ClusterProcess(const std::vector<std::string>& argv, std::string log)
    : log_(std::move(log)) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  pid_ = fork();
  if (pid_ == 0) {
    // Only async-signal-safe calls here; the child dies with the benchmark.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fd);
}

ClusterProcess::~ClusterProcess() {
  if (pid_ <= 0 || exited_) return;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    absl::SleepFor(absl::Milliseconds(20));  // shutdown pacing, 2 s in all
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
}

bool ClusterProcess::Exited() {
  if (pid_ <= 0) return true;
  if (!exited_ && waitpid(pid_, nullptr, WNOHANG) == pid_) exited_ = true;
  return exited_;
}

std::string ClusterProcess::Log() const {
  std::ifstream f(log_);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

absl::StatusOr<int> ClusterProcess::LoggedInt(const std::string& msg,
                                              const std::string& field,
                                              absl::Time deadline) {
  const std::regex re("\"msg\":\"" + msg + "\".*\"" + field + "\":([0-9]+)");
  while (true) {
    std::smatch m;
    const std::string log = Log();
    if (std::regex_search(log, m, re)) return std::stoi(m[1]);
    if (Exited()) {
      return absl::UnavailableError(absl::StrCat(log_, ": exited before '", msg, "'"));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(log_, ": no '", msg, "' in time"));
    }
    absl::SleepFor(absl::Milliseconds(20));  // start-up polling
  }
}

namespace {

std::string Tail(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(s.size() - n);
}

absl::StatusOr<double> RouterWorkers(int metrics_port, const std::string& role) {
  auto get = metrics::HttpGet("127.0.0.1", metrics_port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  return parsed->Value("tandem_router_workers", {{"role", role}});
}

bool Probe(int router_port) {
  auto stub = v1::Router::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", router_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GenerateRequest probe;
  probe.set_request_id("trace-bench-probe");
  probe.mutable_prompt_token_ids()->add_ids(100);
  probe.mutable_stop()->set_max_tokens(1);
  auto reader = stub->Generate(&ctx, probe);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  return reader->Finish().ok();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TraceCluster>> TraceCluster::Start(
    const ClusterOptions& o) {
  std::unique_ptr<TraceCluster> c(new TraceCluster());
  const absl::Time deadline = absl::Now() + o.start_timeout;
  const std::string prefix = absl::StrCat(o.log_dir, "/", o.name, "_");
  c->router_ = std::make_unique<ClusterProcess>(
      std::vector<std::string>{
          o.bin_dir + "/router/router_main", "--model=" + o.model, "--port=0",
          "--metrics_port=0", "--log_format=json", "--heartbeat_interval_s=0.2",
          "--routing_policy=" + o.routing_policy,
          // Every prompt to a prefill worker: the bench compares the prefill
          // workers' hits and load across policies (docs/benchmarks.md,
          // "trace"), and at --length-scale 0.125 most prompts are below the
          // router's default --colocate_below_tokens (1000).
          "--colocate_below_tokens=0",
          absl::StrCat("--max_in_flight=", o.router_max_in_flight)},
      prefix + "router.log");
  if (!c->router_->started()) return absl::InternalError("cannot start the router");
  auto grpc_port = c->router_->LoggedInt("router serving", "grpc_port", deadline);
  auto metrics_port = c->router_->LoggedInt("router serving", "metrics_port", deadline);
  if (!grpc_port.ok() || !metrics_port.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "router did not start: ",
        (grpc_port.ok() ? metrics_port.status() : grpc_port.status()).message(), "\n",
        Tail(c->router_->Log(), 4000)));
  }
  c->router_port_ = *grpc_port;
  c->router_metrics_port_ = *metrics_port;
  for (const char* role : {"decode", "prefill"}) {
    const int n = std::string(role) == "decode" ? o.decode_workers : o.prefill_workers;
    for (int i = 0; i < n; ++i) {
      WorkerProcess w;
      w.role = role;
      w.id = absl::StrCat(role, "-", i);
      std::vector<std::string> argv = {
          absl::StrCat(o.bin_dir, "/", role, "/", role, "_main"),
          "--model=" + o.model,
          "--worker_id=" + w.id,
          absl::StrCat("--router=127.0.0.1:", c->router_port_),
          "--port=0",
          "--metrics_port=0",
          absl::StrCat("--max_num_seqs=", o.max_num_seqs),
          "--kv_cache_memory=" + o.kv_cache_memory,
          absl::StrCat("--enable_prefix_caching=", o.prefix_caching ? "true" : "false"),
          "--log_format=json"};
      if (o.max_model_len > 0) {
        argv.push_back(absl::StrCat("--max_model_len=", o.max_model_len));
      }
      w.process = std::make_unique<ClusterProcess>(argv, prefix + w.id + ".log");
      if (!w.process->started()) return absl::InternalError("cannot start " + w.id);
      c->workers_.push_back(std::move(w));
    }
  }
  for (WorkerProcess& w : c->workers_) {
    auto g = w.process->LoggedInt("worker serving", "grpc_port", deadline);
    auto m = w.process->LoggedInt("worker serving", "metrics_port", deadline);
    if (!g.ok() || !m.ok()) {
      return absl::UnavailableError(absl::StrCat(
          w.id, " did not start: ", (g.ok() ? m.status() : g.status()).message(), "\n",
          Tail(w.process->Log(), 4000)));
    }
    w.grpc_port = *g;
    w.metrics_port = *m;
  }
  for (const auto& [role, n] :
       {std::pair<std::string, int>{"prefill", o.prefill_workers},
        {"decode", o.decode_workers}}) {
    while (true) {
      auto v = RouterWorkers(c->router_metrics_port_, role);
      if (v.ok() && *v >= n) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("only ", v.ok() ? *v : 0, " of ", n, " ", role,
                         " workers registered in time\n", c->LogTails()));
      }
      absl::SleepFor(absl::Milliseconds(50));  // registration polling
    }
  }
  while (!Probe(c->router_port_)) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("the probe request did not succeed in time\n" +
                                         c->LogTails());
    }
    absl::SleepFor(absl::Milliseconds(100));  // readiness polling
  }
  return c;
}

absl::StatusOr<std::map<std::string, double>> TraceCluster::ScrapeWorker(
    const WorkerProcess& w, const std::vector<std::string>& names) const {
  auto get =
      metrics::HttpGet("127.0.0.1", w.metrics_port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  std::map<std::string, double> out;
  for (const std::string& name : names) {
    auto v = parsed->Value(name);
    if (!v.ok()) {
      return absl::NotFoundError(
          absl::StrCat(w.id, "'s /metrics has no ", name, ": ", v.status().message()));
    }
    out[name] = *v;
  }
  return out;
}

absl::StatusOr<std::map<std::string, double>> TraceCluster::ScrapeRouterChoices()
    const {
  auto get =
      metrics::HttpGet("127.0.0.1", router_metrics_port_, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  std::map<std::string, double> out;
  for (const metrics::ParsedSample* s :
       parsed->Find("tandem_router_prefill_choices_total")) {
    auto reason = s->labels.find("reason");
    out[reason == s->labels.end() ? "" : reason->second] += s->value;
  }
  return out;
}

std::string TraceCluster::LogTails() const {
  std::string s = "--- router\n" + Tail(router_->Log(), 2000);
  for (const WorkerProcess& w : workers_) {
    s += "\n--- " + w.id + "\n" + Tail(w.process->Log(), 2000);
  }
  return s;
}

}  // namespace tandem::bench
