// Serving load generator in the style of vLLM's benchmark_serving: requests with
// synthetic prompt and output lengths (uniform in flag ranges) arrive as a Poisson
// process at --request_rate against a Tandem router's Generate stream, and the
// run reports TTFT, TPOT and inter-token latency percentiles, request and
// output-token throughput and goodput under an SLO.
//
// With --spawn (the default) it starts its own router + prefill + decode
// processes twice (binaries next to it in bazel-bin) and runs the same workload
// against a disaggregated cluster and a colocated one (router
// --colocate_below_tokens large, so every request is prefilled on the decode
// worker); the colocated cluster also measures the latency the router adds over
// calling the decode worker's Generate directly with the same prompts. With
// --nospawn it runs the load against --router only.
//
// --sampling_mix gives each request one of several sampling settings (greedy,
// temperature with top-p / top-k / min-p / penalties; every sampled request
// seeded). Queue time is reported apart from TTFT (which includes it): the
// router's tandem_router_queue_seconds histogram scraped before and after the
// load (spawn mode, or --router_metrics_port with --nospawn), as count, mean and
// bucket-interpolated percentiles of the waits. --preset=load512 is issue 16's
// load test: 512 streams at once, mixed sampling, on a disaggregated cluster
// sized as `./tandem up`'s (256 sequences, --max_in_flight 256, 0.05 of memory
// per worker, the model's own context).
//
// Ends with one JSON line {"bench":"serving",...} on stdout.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/init.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "nlohmann/json.hpp"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"

ABSL_FLAG(std::string, router, "", "host:port of a running router (with --nospawn).");
ABSL_FLAG(bool, spawn, true,
          "Start own clusters (disaggregated, then colocated) instead of --router.");
ABSL_FLAG(std::string, bin_dir, "",
          "Directory holding router/router_main, prefill/prefill_main and "
          "decode/decode_main (default: bazel-bin, found from this binary's path).");
ABSL_FLAG(std::string, model, "",
          "Checkpoint directory for spawned processes (default: the tiny checkpoint "
          "in bazel-bin).");
ABSL_FLAG(int, num_prompts, 64, "Requests to send.");
ABSL_FLAG(double, request_rate, 4,
          "Mean arrivals per second (Poisson); 0: all at once.");
ABSL_FLAG(int, input_len_min, 16, "Shortest prompt (tokens).");
ABSL_FLAG(int, input_len_max, 256, "Longest prompt (tokens).");
ABSL_FLAG(int, output_len_min, 8, "Shortest output (tokens; EOS ignored).");
ABSL_FLAG(int, output_len_max, 64, "Longest output (tokens).");
ABSL_FLAG(double, temperature, 0,
          "Sampling temperature (0: greedy) of every request, without --sampling_mix.");
ABSL_FLAG(
    std::string, sampling_mix, "",
    "Sampling settings drawn per request (uniformly, from --seed): comma-separated "
    "entries, each 'greedy' or colon-separated key=value of t (temperature), "
    "top_p, top_k, min_p, rep (repetition penalty), presence, frequency; e.g. "
    "'greedy,t=0.7:top_p=0.9,t=1:top_k=40'. 'mixed' is greedy and four sampled "
    "settings. Every sampled request is seeded (its index).");
ABSL_FLAG(std::string, clusters, "disaggregated,colocated",
          "Spawn mode: which clusters to run, in order (disaggregated, colocated).");
ABSL_FLAG(
    int, router_max_in_flight, 100000,
    "--max-in-flight of the spawned router (past it requests wait in its queue).");
ABSL_FLAG(int, router_metrics_port, 0,
          "With --nospawn: the router's /metrics port (on --router's host), to report "
          "queue time; 0: not reported.");
ABSL_FLAG(std::string, preset, "",
          "load512: --num_prompts=512 --request_rate=0 --sampling_mix=mixed "
          "--clusters=disaggregated --max_num_seqs=256 --router_max_in_flight=256 "
          "--kv_cache_memory=0.05 --max_model_len=0 --timeout_s=900 (flags given on "
          "the command line win).");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the workload (lengths, prompts, arrivals).");
ABSL_FLAG(double, slo_ttft_ms, 1000, "Goodput SLO: time to first token.");
ABSL_FLAG(double, slo_tpot_ms, 100, "Goodput SLO: time per output token.");
ABSL_FLAG(int, max_num_seqs, 16, "--max_num_seqs of spawned workers.");
ABSL_FLAG(int, max_model_len, 1024,
          "--max_model_len of spawned workers (0: theirs, the model's context).");
ABSL_FLAG(std::string, kv_cache_memory, "256MiB",
          "--kv_cache_memory of spawned workers.");
ABSL_FLAG(int, overhead_prompts, 16,
          "Prompts run one at a time through the router and directly on the decode "
          "worker to measure the router's latency (spawn mode).");
ABSL_FLAG(double, timeout_s, 300, "Deadline of each request.");

namespace {

using Clock = std::chrono::steady_clock;

double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Workload {
  std::vector<tandem::v1::GenerateRequest> requests;
  std::vector<double> arrival_s;  // offsets from the start
};

struct Outcome {
  bool ok = false;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string error;
  double ttft = 0, e2e = 0;
  std::vector<double> itl;
  int output_tokens = 0;
};

template <typename Stub>
Outcome RunOne(Stub* stub, const tandem::v1::GenerateRequest& req, double timeout_s) {
  Outcome o;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    if (m.token_ids_size() == 0) continue;
    const Clock::time_point now = Clock::now();
    if (o.output_tokens == 0) {
      o.ttft = Sec(now - start);
    } else {
      // Several tokens in one message share its arrival: one gap, then zeros.
      o.itl.push_back(Sec(now - last));
      for (int i = 1; i < m.token_ids_size(); ++i) o.itl.push_back(0);
    }
    if (o.output_tokens == 0) {
      for (int i = 1; i < m.token_ids_size(); ++i) o.itl.push_back(0);
    }
    o.output_tokens += m.token_ids_size();
    last = now;
  }
  grpc::Status s = reader->Finish();
  o.e2e = Sec(Clock::now() - start);
  o.ok = s.ok();
  o.code = s.error_code();
  if (!s.ok()) o.error = absl::StrCat(s.error_code(), ": ", s.error_message());
  return o;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100 * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - lo);
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

nlohmann::json Dist(const std::vector<double>& seconds) {
  return {{"mean_ms", Mean(seconds) * 1000},
          {"p50_ms", Percentile(seconds, 50) * 1000},
          {"p90_ms", Percentile(seconds, 90) * 1000},
          {"p99_ms", Percentile(seconds, 99) * 1000}};
}

// One entry of --sampling_mix.
struct SamplingSetting {
  std::string name;
  tandem::v1::SamplingParams params;
};

constexpr char kMixed[] =
    "greedy,t=0.7:top_p=0.9,t=1:top_k=40,t=0.9:min_p=0.05:rep=1.1,"
    "t=1.2:top_p=0.95:presence=0.5:frequency=0.3";

// Parses --sampling_mix; an empty list means one setting from --temperature.
absl::StatusOr<std::vector<SamplingSetting>> ParseSamplingMix(std::string spec) {
  std::vector<SamplingSetting> out;
  if (spec.empty()) {
    SamplingSetting one;
    one.params.set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
    one.name = absl::StrCat("t=", one.params.temperature());
    out.push_back(one);
    return out;
  }
  if (spec == "mixed") spec = kMixed;
  for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    SamplingSetting st;
    st.name = std::string(entry);
    if (entry != "greedy") {
      for (absl::string_view kv : absl::StrSplit(entry, ':')) {
        std::pair<std::string, std::string> p = absl::StrSplit(kv, '=');
        float v = 0;
        if (!absl::SimpleAtof(p.second, &v)) {
          return absl::InvalidArgumentError(absl::StrCat("--sampling_mix: '", kv, "'"));
        }
        tandem::v1::SamplingParams& s = st.params;
        if (p.first == "t")
          s.set_temperature(v);
        else if (p.first == "top_p")
          s.set_top_p(v);
        else if (p.first == "top_k")
          s.set_top_k(static_cast<int>(v));
        else if (p.first == "min_p")
          s.set_min_p(v);
        else if (p.first == "rep")
          s.set_repetition_penalty(v);
        else if (p.first == "presence")
          s.set_presence_penalty(v);
        else if (p.first == "frequency")
          s.set_frequency_penalty(v);
        else
          return absl::InvalidArgumentError(
              absl::StrCat("--sampling_mix: unknown key '", p.first, "'"));
      }
    }
    out.push_back(st);
  }
  if (out.empty()) return absl::InvalidArgumentError("--sampling_mix is empty");
  return out;
}

Workload MakeWorkload(int vocab, const std::vector<SamplingSetting>& mix,
                      std::map<std::string, int>* mix_counts) {
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::uniform_int_distribution<size_t> pick(0, mix.size() - 1);
  std::uniform_int_distribution<int> in_len(absl::GetFlag(FLAGS_input_len_min),
                                            absl::GetFlag(FLAGS_input_len_max));
  std::uniform_int_distribution<int> out_len(absl::GetFlag(FLAGS_output_len_min),
                                             absl::GetFlag(FLAGS_output_len_max));
  // Ordinary ids, away from the special tokens at the top of the vocabulary.
  std::uniform_int_distribution<int> token(100, std::max(101, vocab / 2));
  const double rate = absl::GetFlag(FLAGS_request_rate);
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1);
  Workload w;
  double t = 0;
  for (int i = 0; i < absl::GetFlag(FLAGS_num_prompts); ++i) {
    tandem::v1::GenerateRequest req;
    req.set_request_id(absl::StrCat("bench-", i));
    const int n = in_len(rng);
    for (int k = 0; k < n; ++k) req.mutable_prompt_token_ids()->add_ids(token(rng));
    req.mutable_stop()->set_max_tokens(out_len(rng));
    req.mutable_stop()->set_ignore_eos(true);
    const SamplingSetting& st = mix.size() == 1 ? mix[0] : mix[pick(rng)];
    *req.mutable_sampling() = st.params;
    req.mutable_sampling()->set_seed(i);
    ++(*mix_counts)[st.name];
    w.requests.push_back(std::move(req));
    w.arrival_s.push_back(t);
    if (rate > 0) t += gap(rng);
  }
  return w;
}

// A scrape of the router's tandem_router_queue_seconds histogram.
struct QueueHistogram {
  bool ok = false;
  std::map<double, double> cumulative;  // le -> count
  double count = 0, sum = 0;
};

QueueHistogram ScrapeQueue(const std::string& host, int port) {
  QueueHistogram h;
  if (port == 0) return h;
  auto get = tandem::metrics::HttpGet(host, port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return h;
  auto parsed = tandem::metrics::ParseText(get->body);
  if (!parsed.ok()) return h;
  for (const tandem::metrics::ParsedSample* b :
       parsed->Find("tandem_router_queue_seconds_bucket")) {
    auto le = b->labels.find("le");
    if (le == b->labels.end()) continue;
    std::optional<double> bound = tandem::metrics::ParseValue(le->second);
    if (bound) h.cumulative[*bound] = b->value;
  }
  auto count = parsed->Value("tandem_router_queue_seconds_count");
  auto sum = parsed->Value("tandem_router_queue_seconds_sum");
  if (!count.ok() || !sum.ok() || h.cumulative.empty()) return h;
  h.count = *count;
  h.sum = *sum;
  h.ok = true;
  return h;
}

// The waits between two scrapes: count, mean, and percentiles interpolated
// within buckets as Prometheus' histogram_quantile does (the +Inf bucket gives
// its lower bound).
nlohmann::json QueueDelta(const QueueHistogram& a, const QueueHistogram& b) {
  if (!a.ok || !b.ok) return nullptr;
  const double n = b.count - a.count;
  nlohmann::json j = {{"waits", n},
                      {"total_s", b.sum - a.sum},
                      {"mean_ms", n > 0 ? (b.sum - a.sum) / n * 1000 : 0}};
  for (double p : {50.0, 90.0, 99.0}) {
    double q = 0;
    if (n > 0) {
      const double rank = p / 100 * n;
      double prev_le = 0, prev_c = 0;
      for (const auto& [le, c_b] : b.cumulative) {
        auto it = a.cumulative.find(le);
        const double c = c_b - (it == a.cumulative.end() ? 0 : it->second);
        if (c >= rank) {
          q = std::isinf(le)
                  ? prev_le
                  : prev_le + (le - prev_le) *
                                  (c > prev_c ? (rank - prev_c) / (c - prev_c) : 1);
          break;
        }
        prev_le = std::isinf(le) ? prev_le : le;
        prev_c = c;
      }
    }
    j[absl::StrCat("p", static_cast<int>(p), "_ms")] = q * 1000;
  }
  return j;
}

// Runs the workload with Poisson arrivals; one thread per request in flight.
// `metrics_host`:`metrics_port` (0: none) is the router's /metrics, scraped before
// and after for the queue time.
nlohmann::json RunLoad(tandem::v1::Router::Stub* stub, const Workload& w,
                       const std::string& metrics_host = "", int metrics_port = 0) {
  const QueueHistogram queue_before = ScrapeQueue(metrics_host, metrics_port);
  const int n = static_cast<int>(w.requests.size());
  std::vector<Outcome> out(n);
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<Clock::duration>(
                    std::chrono::duration<double>(w.arrival_s[i])));  // arrival pacing
    threads.emplace_back([&, i] {
      out[i] = RunOne(stub, w.requests[i], absl::GetFlag(FLAGS_timeout_s));
    });
  }
  for (auto& t : threads) t.join();
  const double duration = Sec(Clock::now() - start);
  const QueueHistogram queue_after = ScrapeQueue(metrics_host, metrics_port);
  std::vector<double> ttft, tpot, itl, e2e;
  int ok = 0, good = 0, refused = 0;
  int64_t out_tokens = 0, in_tokens = 0;
  std::string first_error;
  for (int i = 0; i < n; ++i) {
    const Outcome& o = out[i];
    if (!o.ok) {
      if (o.code == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
      if (first_error.empty()) first_error = o.error;
      continue;
    }
    ++ok;
    out_tokens += o.output_tokens;
    in_tokens += w.requests[i].prompt_token_ids().ids_size();
    ttft.push_back(o.ttft);
    e2e.push_back(o.e2e);
    const double t = o.output_tokens > 1 ? (o.e2e - o.ttft) / (o.output_tokens - 1) : 0;
    if (o.output_tokens > 1) tpot.push_back(t);
    itl.insert(itl.end(), o.itl.begin(), o.itl.end());
    if (o.ttft * 1000 <= absl::GetFlag(FLAGS_slo_ttft_ms) &&
        t * 1000 <= absl::GetFlag(FLAGS_slo_tpot_ms)) {
      ++good;
    }
  }
  nlohmann::json j = {{"completed", ok},
                      {"failed", n - ok},
                      {"refused", refused},
                      {"duration_s", duration},
                      {"input_tokens", in_tokens},
                      {"output_tokens", out_tokens},
                      {"request_throughput", ok / duration},
                      {"output_throughput", out_tokens / duration},
                      {"goodput", good / duration},
                      {"good_requests", good},
                      {"ttft", Dist(ttft)},
                      {"tpot", Dist(tpot)},
                      {"itl", Dist(itl)},
                      {"e2e", Dist(e2e)},
                      {"queue", QueueDelta(queue_before, queue_after)}};
  if (!first_error.empty()) j["first_error"] = first_error;
  return j;
}

void Print(const std::string& name, const nlohmann::json& r) {
  fprintf(stderr,
          "== %s: %d ok, %d failed (%d refused) in %.2f s\n"
          "   request throughput %.2f req/s, output %.1f tok/s, goodput %.2f req/s "
          "(%d within SLO)\n",
          name.c_str(), r["completed"].get<int>(), r["failed"].get<int>(),
          r["refused"].get<int>(), r["duration_s"].get<double>(),
          r["request_throughput"].get<double>(), r["output_throughput"].get<double>(),
          r["goodput"].get<double>(), r["good_requests"].get<int>());
  for (const char* k : {"ttft", "tpot", "itl", "e2e"}) {
    fprintf(stderr, "   %-4s mean %8.1f  p50 %8.1f  p90 %8.1f  p99 %8.1f ms\n", k,
            r[k]["mean_ms"].get<double>(), r[k]["p50_ms"].get<double>(),
            r[k]["p90_ms"].get<double>(), r[k]["p99_ms"].get<double>());
  }
  if (r["queue"].is_null()) {
    fprintf(stderr, "   queue: not measured (no router /metrics)\n");
  } else {
    const nlohmann::json& q = r["queue"];
    fprintf(stderr,
            "   queue %.0f waits, mean %8.1f  p50 %8.1f  p90 %8.1f  p99 %8.1f ms "
            "(router tandem_router_queue_seconds; TTFT includes it)\n",
            q["waits"].get<double>(), q["mean_ms"].get<double>(),
            q["p50_ms"].get<double>(), q["p90_ms"].get<double>(),
            q["p99_ms"].get<double>());
  }
  if (r.contains("first_error")) {
    fprintf(stderr, "   first error: %s\n",
            r["first_error"].get<std::string>().c_str());
  }
}

// --- spawned processes -------------------------------------------------------

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
      // Only async-signal-safe calls here. The child dies with the benchmark,
      // so an interrupted run leaves no cluster behind.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(fd, 1);
      dup2(fd, 2);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fd);
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      for (int i = 0; i < 100; ++i) {
        if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        absl::SleepFor(absl::Milliseconds(20));
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool started() const { return pid_ > 0; }
  std::string Log() const {
    std::ifstream f(log_);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  // The port logged in the "<msg>" line's `field` (JSON logs), 0 on timeout.
  int Port(const std::string& msg, const std::string& field) const {
    const std::regex re("\"msg\":\"" + msg + "\".*\"" + field + "\":([0-9]+)");
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (absl::Now() < end) {
      std::smatch m;
      const std::string log = Log();
      if (std::regex_search(log, m, re)) return std::stoi(m[1]);
      absl::SleepFor(absl::Milliseconds(20));
    }
    return 0;
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

struct Cluster {
  std::unique_ptr<Child> router, prefill, decode;
  int router_port = 0, router_metrics_port = 0, decode_port = 0;
};

std::string BinDir() {
  if (!absl::GetFlag(FLAGS_bin_dir).empty()) return absl::GetFlag(FLAGS_bin_dir);
  return std::filesystem::canonical("/proc/self/exe").parent_path().parent_path();
}

// Value of a router metric, or -1.
double RouterMetric(int port, const std::string& name,
                    const std::map<std::string, std::string>& labels) {
  auto get = tandem::metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return -1;
  auto parsed = tandem::metrics::ParseText(get->body);
  if (!parsed.ok()) return -1;
  auto v = parsed->Value(name, labels);
  return v.ok() ? *v : -1;
}

bool WaitReady(tandem::v1::Router::Stub* stub, int router_metrics_port) {
  // Ready once both workers registered and a probe request succeeds.
  const absl::Time end = absl::Now() + absl::Seconds(60);
  for (const char* role : {"prefill", "decode"}) {
    while (RouterMetric(router_metrics_port, "tandem_router_workers",
                        {{"role", role}}) < 1) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(50));  // registration pacing
    }
  }
  tandem::v1::GenerateRequest probe;
  probe.mutable_prompt_token_ids()->add_ids(100);
  probe.mutable_stop()->set_max_tokens(1);
  while (absl::Now() < end) {
    if (RunOne(stub, probe, 10).ok) return true;
    absl::SleepFor(absl::Milliseconds(100));  // registration pacing
  }
  return false;
}

std::unique_ptr<Cluster> StartCluster(const std::string& name, int colocate_below) {
  const std::string bin = BinDir();
  std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) model = bin + "/engine/model/tiny_checkpoint";
  const std::string tmp =
      std::filesystem::temp_directory_path() / absl::StrCat("serving_bench.", getpid());
  std::filesystem::create_directories(tmp);
  auto c = std::make_unique<Cluster>();
  c->router = std::make_unique<Child>(
      std::vector<std::string>{
          bin + "/router/router_main", "--model=" + model, "--port=0",
          "--metrics_port=0", "--log_format=json", "--heartbeat_interval_s=0.2",
          absl::StrCat("--colocate_below_tokens=", colocate_below),
          absl::StrCat("--max_in_flight=", absl::GetFlag(FLAGS_router_max_in_flight))},
      tmp + "/" + name + "_router.log");
  c->router_port = c->router->Port("router serving", "grpc_port");
  c->router_metrics_port = c->router->Port("router serving", "metrics_port");
  if (c->router_port == 0) {
    fprintf(stderr, "router did not start:\n%s\n", c->router->Log().c_str());
    return nullptr;
  }
  for (const char* role : {"decode", "prefill"}) {
    std::vector<std::string> argv = {
        bin + "/" + role + "/" + role + "_main",
        "--model=" + model,
        std::string("--worker_id=") + role + "-0",
        absl::StrCat("--router=127.0.0.1:", c->router_port),
        "--port=0",
        "--metrics_port=0",
        absl::StrCat("--max_num_seqs=", absl::GetFlag(FLAGS_max_num_seqs)),
        absl::StrCat("--kv_cache_memory=", absl::GetFlag(FLAGS_kv_cache_memory)),
        "--log_format=json"};
    if (absl::GetFlag(FLAGS_max_model_len) > 0) {
      argv.push_back(
          absl::StrCat("--max_model_len=", absl::GetFlag(FLAGS_max_model_len)));
    }
    auto w = std::make_unique<Child>(argv, tmp + "/" + name + "_" + role + ".log");
    (std::string(role) == "decode" ? c->decode : c->prefill) = std::move(w);
  }
  c->decode_port = c->decode->Port("worker serving", "grpc_port");
  if (c->decode_port == 0) {
    fprintf(stderr, "decode worker did not start:\n%s\n", c->decode->Log().c_str());
    return nullptr;
  }
  return c;
}

std::unique_ptr<tandem::v1::Router::Stub> RouterStub(const std::string& addr) {
  return tandem::v1::Router::NewStub(
      grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
}

int VocabOf(tandem::v1::Router::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  tandem::v1::ListModelsResponse resp;
  grpc::Status s = stub->ListModels(&ctx, {}, &resp);
  if (!s.ok() || resp.models_size() == 0) return 0;
  return resp.models(0).vocab_size();
}

// Same prompts one at a time via the router and directly on the decode worker.
nlohmann::json RouterOverhead(tandem::v1::Router::Stub* router, int decode_port,
                              const Workload& w) {
  auto decode = tandem::v1::DecodeWorker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", decode_port), grpc::InsecureChannelCredentials()));
  std::vector<double> dttft, de2e;
  const int n = std::min<int>(absl::GetFlag(FLAGS_overhead_prompts), w.requests.size());
  for (int i = 0; i < n; ++i) {
    tandem::v1::GenerateRequest req = w.requests[i];
    // Alternate which goes first, so that neither always finds warm caches.
    Outcome via, direct;
    for (int k = 0; k < 2; ++k) {
      if ((i + k) % 2 == 0) {
        req.set_request_id(absl::StrCat("overhead-router-", i));
        via = RunOne(router, req, absl::GetFlag(FLAGS_timeout_s));
      } else {
        req.set_request_id(absl::StrCat("overhead-direct-", i));
        direct = RunOne(decode.get(), req, absl::GetFlag(FLAGS_timeout_s));
      }
    }
    if (!via.ok || !direct.ok) continue;
    dttft.push_back(via.ttft - direct.ttft);
    de2e.push_back(via.e2e - direct.e2e);
  }
  nlohmann::json j = {
      {"pairs", dttft.size()}, {"ttft_added", Dist(dttft)}, {"e2e_added", Dist(de2e)}};
  fprintf(
      stderr,
      "== router overhead (%zu prompts one at a time, router vs DecodeWorker.Generate "
      "directly): TTFT +%.2f ms p50 (+%.2f p90), e2e +%.2f ms p50 (+%.2f p90)\n",
      dttft.size(), Percentile(dttft, 50) * 1000, Percentile(dttft, 90) * 1000,
      Percentile(de2e, 50) * 1000, Percentile(de2e, 90) * 1000);
  return j;
}

// The flag names argv gives (hyphens as underscores, "no" of booleans kept).
std::set<std::string> GivenFlags(int argc, char** argv) {
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.rfind("-", 0) != 0) continue;
    a = a.substr(a.find_first_not_of('-'));
    a = a.substr(0, a.find('='));
    std::replace(a.begin(), a.end(), '-', '_');
    given.insert(a);
    if (a.rfind("no", 0) == 0) given.insert(a.substr(2));
  }
  return given;
}

// --preset: sets the flags the command line did not give.
bool ApplyPreset(const std::string& preset, const std::set<std::string>& given) {
  if (preset.empty()) return true;
  if (preset != "load512") return false;
  auto set = [&](const char* name, const std::string& value) {
    absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    std::string err;
    if (f != nullptr && given.count(name) == 0) f->ParseFrom(value, &err);
  };
  set("num_prompts", "512");
  set("request_rate", "0");
  set("sampling_mix", "mixed");
  set("clusters", "disaggregated");
  set("max_num_seqs", "256");
  set("router_max_in_flight", "256");
  set("kv_cache_memory", "0.05");
  set("max_model_len", "0");
  set("timeout_s", "900");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::set<std::string> given = GivenFlags(argc, argv);
  tandem::InitProgram(argc, argv, "serving_bench",
                      "Poisson-arrival serving benchmark of a Tandem cluster.\n"
                      "usage: serving_bench [--num_prompts=64] [--request_rate=4] "
                      "[--nospawn --router=HOST:PORT [--router_metrics_port=N]] "
                      "[--sampling_mix=mixed] [--preset=load512] "
                      "[--slo_ttft_ms --slo_tpot_ms]");
  signal(SIGPIPE, SIG_IGN);
  if (!ApplyPreset(absl::GetFlag(FLAGS_preset), given)) {
    fprintf(stderr, "serving_bench: unknown --preset '%s' (load512)\n",
            absl::GetFlag(FLAGS_preset).c_str());
    return 2;
  }
  auto mix = ParseSamplingMix(absl::GetFlag(FLAGS_sampling_mix));
  if (!mix.ok()) {
    fprintf(stderr, "serving_bench: %s\n", std::string(mix.status().message()).c_str());
    return 2;
  }
  std::map<std::string, int> mix_counts;
  nlohmann::json result = {
      {"bench", "serving"},
      {"num_prompts", absl::GetFlag(FLAGS_num_prompts)},
      {"request_rate", absl::GetFlag(FLAGS_request_rate)},
      {"input_len",
       {absl::GetFlag(FLAGS_input_len_min), absl::GetFlag(FLAGS_input_len_max)}},
      {"output_len",
       {absl::GetFlag(FLAGS_output_len_min), absl::GetFlag(FLAGS_output_len_max)}},
      {"slo_ttft_ms", absl::GetFlag(FLAGS_slo_ttft_ms)},
      {"slo_tpot_ms", absl::GetFlag(FLAGS_slo_tpot_ms)},
      {"preset", absl::GetFlag(FLAGS_preset)}};
  if (!absl::GetFlag(FLAGS_spawn)) {
    if (absl::GetFlag(FLAGS_router).empty()) {
      fprintf(stderr, "serving_bench: --nospawn needs --router=HOST:PORT\n");
      return 2;
    }
    auto stub = RouterStub(absl::GetFlag(FLAGS_router));
    const int vocab = VocabOf(stub.get());
    if (vocab == 0) {
      fprintf(stderr, "serving_bench: ListModels failed at %s\n",
              absl::GetFlag(FLAGS_router).c_str());
      return 1;
    }
    const std::string host =
        absl::GetFlag(FLAGS_router).substr(0, absl::GetFlag(FLAGS_router).rfind(':'));
    nlohmann::json r = RunLoad(stub.get(), MakeWorkload(vocab, *mix, &mix_counts), host,
                               absl::GetFlag(FLAGS_router_metrics_port));
    Print("router " + absl::GetFlag(FLAGS_router), r);
    result["router"] = r;
    result["sampling_mix"] = mix_counts;
    printf("%s\n", result.dump().c_str());
    return r["failed"].get<int>() == 0 ? 0 : 1;
  }
  int failed = 0;
  for (const std::string& mode : std::vector<std::string>(
           absl::StrSplit(absl::GetFlag(FLAGS_clusters), ',', absl::SkipEmpty()))) {
    if (mode != "disaggregated" && mode != "colocated") {
      fprintf(stderr, "serving_bench: --clusters: unknown '%s'\n", mode.c_str());
      return 2;
    }
    const bool colocated = mode == "colocated";
    auto c = StartCluster(mode, colocated ? 1 << 30 : 0);
    if (!c) return 1;
    auto stub = RouterStub(absl::StrCat("127.0.0.1:", c->router_port));
    if (!WaitReady(stub.get(), c->router_metrics_port)) {
      fprintf(stderr, "serving_bench: %s cluster not ready\n%s%s%s", mode.c_str(),
              c->router->Log().c_str(), c->prefill->Log().c_str(),
              c->decode->Log().c_str());
      return 1;
    }
    mix_counts.clear();
    const Workload w = MakeWorkload(VocabOf(stub.get()), *mix, &mix_counts);
    nlohmann::json r = RunLoad(stub.get(), w, "127.0.0.1", c->router_metrics_port);
    // How the router actually served them (the probe request included).
    for (const char* path : {"disaggregated", "colocated"}) {
      r["router_paths"][path] = RouterMetric(
          c->router_metrics_port, "tandem_router_paths_total", {{"path", path}});
    }
    Print(mode, r);
    failed += r["failed"].get<int>();
    result[mode] = r;
    result["sampling_mix"] = mix_counts;
    if (colocated)
      result["router_overhead"] = RouterOverhead(stub.get(), c->decode_port, w);
  }
  printf("%s\n", result.dump().c_str());
  return failed == 0 ? 0 : 1;
}
