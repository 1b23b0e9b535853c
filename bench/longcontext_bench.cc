// Long-context benchmark (issue 16, item 3): prompts of --sizes tokens, one at a
// time, through a disaggregated cluster it starts itself (router_main +
// prefill_main + decode_main on localhost, binaries next to it in bazel-bin,
// the tiny checkpoint by default), greedy with --output_tokens tokens each.
// Per size it prints the prefill time (time to first token), the time per
// output token after the first, the state the prefill worker transferred (bytes
// and seconds, from its /metrics) and both workers' peak RSS (VmHWM); then the
// growth exponent k of prefill time (least squares of log t on log n) and a
// linear + quadratic fit t = a n + b n^2, which says how much of the time the
// quadratic part (MLA attention over the whole prefix) takes at each size.
//
// A K3-length prompt (--long_tokens, 1,048,576 - output by default) is then
// submitted: it must be admitted (the router and both workers accept its
// length, the cache holds it) — with --run_long it runs to the end, otherwise
// it is cancelled once the prefill worker is computing it (its deadline, 5 s)
// and its prefill time is projected from the fits.
//
//   ./tandem bench longcontext [--sizes=1024,4096] [--output_tokens=16]
//       [--kv_cache_memory=1GiB] [--run_long] [--long_tokens=N]
//
// Ends with one JSON line {"bench":"longcontext",...} on stdout.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/init.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "nlohmann/json.hpp"
#include "proto/router.grpc.pb.h"

ABSL_FLAG(std::string, sizes, "1024,4096",
          "Prompt lengths (tokens), comma-separated; the issue's set is "
          "4096,16384,65536,131072,262144.");
ABSL_FLAG(int, output_tokens, 16, "Tokens generated per prompt (greedy, EOS ignored).");
ABSL_FLAG(std::string, kv_cache_memory, "1GiB",
          "--kv_cache_memory of the spawned workers (the tiny model's 1M-token "
          "context needs 160 MiB of MLA cache).");
ABSL_FLAG(bool, run_long, false,
          "Run the K3-length prompt to the end (else: admitted, then cancelled, and "
          "its prefill time projected).");
ABSL_FLAG(
    int64_t, long_tokens, 0,
    "Length of the long prompt (0: the workers' max_model_len minus the output).");
ABSL_FLAG(double, timeout_s, 3600, "Deadline of each request.");
ABSL_FLAG(std::string, bin_dir, "",
          "Directory holding router/router_main, prefill/prefill_main and "
          "decode/decode_main (default: bazel-bin, found from this binary's path).");
ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (default: the tiny checkpoint in bazel-bin).");

namespace {

class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log) : log_(log) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // no cluster left behind
      dup2(fd, 1);
      dup2(fd, 2);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fd);
  }
  ~Child() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  pid_t pid() const { return pid_; }
  std::string Log() const {
    std::ifstream f(log_);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  // The port logged in the "<msg>" line's `field` (JSON logs), 0 on timeout.
  int Port(const std::string& msg, const std::string& field) const {
    const std::regex re("\"msg\":\"" + msg + "\".*\"" + field + "\":([0-9]+)");
    const absl::Time end = absl::Now() + absl::Seconds(120);
    while (absl::Now() < end) {
      std::smatch m;
      const std::string log = Log();
      if (std::regex_search(log, m, re)) return std::stoi(m[1]);
      absl::SleepFor(absl::Milliseconds(50));
    }
    return 0;
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

double MetricOf(int port, const std::string& name,
                const std::map<std::string, std::string>& labels = {}) {
  auto get = tandem::metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return -1;
  auto parsed = tandem::metrics::ParseText(get->body);
  if (!parsed.ok()) return -1;
  auto v = parsed->Value(name, labels);
  return v.ok() ? *v : -1;
}

int64_t PeakRss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmHWM:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kb)) return kb * 1024;
  }
  return -1;
}

std::string BinDir() {
  if (!absl::GetFlag(FLAGS_bin_dir).empty()) return absl::GetFlag(FLAGS_bin_dir);
  return std::filesystem::canonical("/proc/self/exe").parent_path().parent_path();
}

tandem::v1::GenerateRequest Prompt(int64_t n, int output) {
  tandem::v1::GenerateRequest req;
  auto* ids = req.mutable_prompt_token_ids()->mutable_ids();
  ids->Reserve(static_cast<int>(n));
  for (int64_t i = 0; i < n; ++i)
    ids->Add(static_cast<int32_t>((i * 104729 + 17) % 100000));
  req.mutable_stop()->set_max_tokens(output);
  req.mutable_stop()->set_ignore_eos(true);
  return req;
}

struct Run {
  grpc::Status status;
  double ttft_s = 0, total_s = 0;
  int tokens = 0;
};

Run Generate(tandem::v1::Router::Stub* stub, const tandem::v1::GenerateRequest& req,
             absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  const absl::Time t0 = absl::Now();
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse m;
  Run r;
  while (reader->Read(&m)) {
    if (r.tokens == 0 && m.token_ids_size() > 0) {
      r.ttft_s = absl::ToDoubleSeconds(absl::Now() - t0);
    }
    r.tokens += m.token_ids_size();
  }
  r.status = reader->Finish();
  r.total_s = absl::ToDoubleSeconds(absl::Now() - t0);
  return r;
}

// Least squares of y on x.
std::pair<double, double> FitLine(const std::vector<double>& x,
                                  const std::vector<double>& y) {
  const double n = x.size();
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  return {slope, (sy - slope * sx) / n};
}

// t = a n + b n^2 (least squares, no intercept): {a, b}.
std::pair<double, double> FitLinearQuadratic(const std::vector<double>& n,
                                             const std::vector<double>& t) {
  double s2 = 0, s3 = 0, s4 = 0, y1 = 0, y2 = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    s2 += n[i] * n[i];
    s3 += n[i] * n[i] * n[i];
    s4 += n[i] * n[i] * n[i] * n[i];
    y1 += n[i] * t[i];
    y2 += n[i] * n[i] * t[i];
  }
  const double det = s2 * s4 - s3 * s3;
  return {(y1 * s4 - y2 * s3) / det, (s2 * y2 - s3 * y1) / det};
}

int Fail(const std::string& what) {
  fprintf(stderr, "longcontext_bench: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "longcontext_bench",
                      "Long-context prompts through a spawned disaggregated cluster.\n"
                      "usage: longcontext_bench [--sizes=1024,4096] [--run_long]");
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      return Fail(absl::StrCat("--sizes: \"", s, "\" is not a positive length"));
    }
    sizes.push_back(n);
  }
  const int out_tokens = absl::GetFlag(FLAGS_output_tokens);
  if (out_tokens < 2) return Fail("--output_tokens must be >= 2");
  const std::string bin = BinDir();
  std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) model = bin + "/engine/model/tiny_checkpoint";
  const std::string tmp = std::filesystem::temp_directory_path() /
                          absl::StrCat("longcontext_bench.", getpid());
  std::filesystem::create_directories(tmp);
  Child router(
      {bin + "/router/router_main", "--model=" + model, "--port=0", "--metrics_port=0",
       "--log_format=json", "--heartbeat_interval_s=0.5", "--request_timeout_s=86400",
       // Every prompt through the prefill worker (--sizes may be under the
       // router's default --colocate_below_tokens, 1000).
       "--colocate_below_tokens=0"},
      tmp + "/router.log");
  const int router_port = router.Port("router serving", "grpc_port");
  const int router_metrics = router.Port("router serving", "metrics_port");
  if (router_port == 0) return Fail("router did not start:\n" + router.Log());
  std::map<std::string, std::unique_ptr<Child>> workers;
  for (const std::string role : {"prefill", "decode"}) {
    std::vector<std::string> argv = {
        bin + "/" + role + "/" + role + "_main",
        "--model=" + model,
        "--worker_id=" + role + "-0",
        absl::StrCat("--router=127.0.0.1:", router_port),
        "--port=0",
        "--metrics_port=0",
        "--log_format=json",
        "--kv_cache_memory=" + absl::GetFlag(FLAGS_kv_cache_memory)};
    // The reservation is held for the whole (hours-long) prefill of a long prompt.
    if (role == "decode") argv.push_back("--max_lease_s=86400");
    workers[role] = std::make_unique<Child>(argv, tmp + "/" + role + ".log");
  }
  const int prefill_metrics =
      workers["prefill"]->Port("worker serving", "metrics_port");
  const int decode_metrics = workers["decode"]->Port("worker serving", "metrics_port");
  if (prefill_metrics == 0 || decode_metrics == 0) {
    return Fail("a worker did not start:\n" + workers["prefill"]->Log() +
                workers["decode"]->Log());
  }
  auto stub = tandem::v1::Router::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", router_port), grpc::InsecureChannelCredentials()));
  for (const char* role : {"prefill", "decode"}) {
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (MetricOf(router_metrics, "tandem_router_workers", {{"role", role}}) < 1) {
      if (absl::Now() > end)
        return Fail(absl::StrCat("no ", role, " worker registered"));
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  const double max_len = MetricOf(decode_metrics, "tandem_worker_max_model_len_tokens");
  const double prefill_len =
      MetricOf(prefill_metrics, "tandem_worker_max_model_len_tokens");
  const double cache_tokens =
      MetricOf(decode_metrics, "tandem_worker_kv_cache_capacity_tokens");
  printf(
      "cluster: tiny model %s; workers --kv_cache_memory=%s: max_model_len %.0f "
      "(prefill %.0f), decode cache %.0f tokens\n",
      model.c_str(), absl::GetFlag(FLAGS_kv_cache_memory).c_str(), max_len, prefill_len,
      cache_tokens);
  // Warm-up (first-touch of the weights, connections).
  Generate(stub.get(), Prompt(64, 2), absl::Seconds(120));
  printf("%10s %12s %10s %14s %12s %14s %14s\n", "prompt", "prefill_s", "tpot_ms",
         "transfer_MB", "transfer_s", "prefill_rss_MB", "decode_rss_MB");
  nlohmann::ordered_json rows = nlohmann::json::array();
  std::vector<double> xs, ts;
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  for (int64_t n : sizes) {
    const double b0 = MetricOf(prefill_metrics, "tandem_worker_transfer_bytes_total");
    const double s0 = MetricOf(prefill_metrics, "tandem_worker_transfer_seconds_total");
    Run r = Generate(stub.get(), Prompt(n, out_tokens), timeout);
    if (!r.status.ok()) {
      return Fail(absl::StrCat("prompt of ", n, " tokens: ", r.status.error_message()));
    }
    // The transfer counters are refreshed with the heartbeat.
    absl::SleepFor(absl::Seconds(1.2));
    const double bytes =
        MetricOf(prefill_metrics, "tandem_worker_transfer_bytes_total") - b0;
    const double secs =
        MetricOf(prefill_metrics, "tandem_worker_transfer_seconds_total") - s0;
    const double tpot_ms = 1000 * (r.total_s - r.ttft_s) / std::max(1, r.tokens - 1);
    const int64_t prss = PeakRss(workers["prefill"]->pid());
    const int64_t drss = PeakRss(workers["decode"]->pid());
    printf("%10lld %12.3f %10.2f %14.2f %12.4f %14.1f %14.1f\n",
           static_cast<long long>(n), r.ttft_s, tpot_ms, bytes / 1e6, secs,
           prss / 1048576.0, drss / 1048576.0);
    fflush(stdout);
    rows.push_back({{"prompt_tokens", n},
                    {"prefill_s", r.ttft_s},
                    {"tpot_ms", tpot_ms},
                    {"transfer_bytes", bytes},
                    {"transfer_s", secs},
                    {"prefill_peak_rss_bytes", prss},
                    {"decode_peak_rss_bytes", drss}});
    xs.push_back(static_cast<double>(n));
    ts.push_back(r.ttft_s);
  }
  nlohmann::ordered_json summary = {{"bench", "longcontext"}, {"rows", rows}};
  const int64_t long_n =
      absl::GetFlag(FLAGS_long_tokens) > 0
          ? absl::GetFlag(FLAGS_long_tokens)
          : static_cast<int64_t>(std::min(max_len, prefill_len)) - out_tokens;
  double k = 0, a = 0, b = 0;
  if (xs.size() >= 2) {
    std::vector<double> lx, lt;
    for (size_t i = 0; i < xs.size(); ++i) {
      lx.push_back(std::log(xs[i]));
      lt.push_back(std::log(ts[i]));
    }
    k = FitLine(lx, lt).first;
    std::tie(a, b) = FitLinearQuadratic(xs, ts);
    printf(
        "prefill time grows as n^%.2f over %lld..%lld tokens; t = %.3g n + %.3g n^2 "
        "s:\n",
        k, static_cast<long long>(xs.front()), static_cast<long long>(xs.back()), a, b);
    for (double n : {xs.front(), xs.back(), static_cast<double>(long_n)}) {
      const double lin = a * n, quad = b * n * n;
      printf("  at %9.0f tokens: linear part %.1f s, quadratic part %.1f s (%.0f%%)\n",
             n, lin, quad, lin + quad > 0 ? 100 * quad / (lin + quad) : 0);
    }
    summary["growth_exponent"] = k;
    summary["fit_linear_s_per_token"] = a;
    summary["fit_quadratic_s_per_token2"] = b;
  }
  // The K3-length prompt: admitted (length and memory), run or projected.
  const tandem::v1::GenerateRequest long_req = Prompt(long_n, out_tokens);
  const double p0 = MetricOf(prefill_metrics, "tandem_worker_prefill_tokens_total");
  const bool run = absl::GetFlag(FLAGS_run_long);
  Run lr = Generate(stub.get(), long_req, run ? timeout : absl::Seconds(5));
  absl::SleepFor(absl::Seconds(1.2));
  const double computed =
      MetricOf(prefill_metrics, "tandem_worker_prefill_tokens_total") - p0;
  // Admitted: it ran, or it was being prefilled when its deadline came (not
  // refused, not waiting in a queue).
  const bool admitted =
      lr.status.ok() ||
      (lr.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && computed > 0);
  printf(
      "long prompt of %lld tokens: %s (%s; prefill worker computed %.0f of its "
      "tokens)\n",
      static_cast<long long>(long_n), admitted ? "admitted" : "REFUSED",
      lr.status.ok() ? "ran" : lr.status.error_message().c_str(), computed);
  summary["long_prompt_tokens"] = long_n;
  summary["long_admitted"] = admitted;
  if (run && lr.status.ok()) {
    printf("  prefill %.1f s, %.2f ms per output token\n", lr.ttft_s,
           1000 * (lr.total_s - lr.ttft_s) / std::max(1, lr.tokens - 1));
    summary["long_prefill_s"] = lr.ttft_s;
  } else if (xs.size() >= 2) {
    const double n = static_cast<double>(long_n);
    const double power = std::exp(FitLine(
                                      [&] {
                                        std::vector<double> v;
                                        for (double x : xs) v.push_back(std::log(x));
                                        return v;
                                      }(),
                                      [&] {
                                        std::vector<double> v;
                                        for (double t : ts) v.push_back(std::log(t));
                                        return v;
                                      }())
                                      .second) *
                         std::pow(n, k);
    printf("  projected prefill: %.0f s by a n + b n^2, %.0f s by the power law\n",
           a * n + b * n * n, power);
    summary["long_projected_prefill_s"] = a * n + b * n * n;
    summary["long_projected_prefill_power_s"] = power;
  }
  printf("%s\n", summary.dump().c_str());
  std::filesystem::remove_all(tmp);
  return admitted ? 0 : 2;
}
