#include "tests/testing/process_cluster.h"

#include <cstdlib>
#include <future>
#include <regex>

#include "absl/time/clock.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"

namespace tandem::testing {

int LoggedPort(const Subprocess& proc, const std::string& msg, const std::string& field,
               absl::Duration timeout) {
  const std::regex re("\"msg\":\"" + msg + "\".*\"" + field + "\":([0-9]+)");
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    std::smatch m;
    const std::string log = proc.ReadLog();
    if (std::regex_search(log, m, re)) return std::stoi(m[1]);
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

absl::StatusOr<double> Metric(int port, const std::string& name,
                              const std::map<std::string, std::string>& labels) {
  auto get = metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  return parsed->Value(name, labels);
}

bool WaitMetric(int port, const std::string& name,
                const std::map<std::string, std::string>& labels, double want,
                absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    auto v = Metric(port, name, labels);
    if (v.ok() && *v == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

StreamResult Drain(grpc::ClientReaderInterface<tandem::v1::GenerateResponse>* reader,
                   std::function<void(int)> after_message) {
  StreamResult r;
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    ++r.messages;
    if (!m.request_id().empty()) r.request_id = m.request_id();
    r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    if (m.has_usage()) r.usage = m.usage();
    if (after_message) after_message(r.messages);
  }
  r.status = reader->Finish();
  return r;
}

tandem::v1::GenerateRequest MakeRequest(int len, uint64_t seed, int max_tokens,
                                        float temperature) {
  tandem::v1::GenerateRequest req;
  for (int i = 0; i < len; ++i) {
    req.mutable_prompt_token_ids()->add_ids(
        static_cast<int32_t>((seed * 7919 + i * 104729) % 100000));
  }
  req.mutable_stop()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(temperature);
  if (temperature > 0) req.mutable_sampling()->set_seed(seed);
  return req;
}

std::string ProcessCluster::Start(const std::vector<std::string>& router_flags,
                                  int decode_slots,
                                  const std::vector<std::string>& prefill_flags,
                                  const std::vector<std::string>& decode_flags) {
  tmp_ = std::getenv("TEST_TMPDIR");
  // --colocate_below_tokens=0: every request disaggregated. These tests'
  // prompts are far below the router's default (1000) and they test the
  // hand-off; a test may pass its own (the last one counts).
  std::vector<std::string> argv = {RunfilePath("router/router_main"),
                                   std::string("--model=") + kTinyModel,
                                   "--port=0",
                                   "--metrics_port=0",
                                   "--heartbeat_interval_s=0.2",
                                   "--heartbeat_timeout_s=30",
                                   "--colocate_below_tokens=0",
                                   "--log_format=json"};
  argv.insert(argv.end(), router_flags.begin(), router_flags.end());
  auto router = Subprocess::Start(argv, tmp_ + "/router.log");
  if (!router.ok()) return std::string(router.status().message());
  router_ = std::make_unique<Subprocess>(std::move(*router));
  router_port_ = LoggedPort(*router_, "router serving", "grpc_port");
  router_metrics_ = LoggedPort(*router_, "router serving", "metrics_port");
  if (router_port_ == 0) return "router did not log its port\n" + router_->ReadLog();
  for (const std::string role : {"decode", "prefill"}) {
    std::vector<std::string> wargv = {
        RunfilePath(role + "/" + role + "_main"),
        std::string("--model=") + kTinyModel,
        "--worker_id=" + role + "-0",
        "--router=127.0.0.1:" + std::to_string(router_port_),
        "--port=0",
        "--metrics_port=0",
        "--max_num_seqs=" + std::to_string(role == "decode" ? decode_slots : 8),
        "--max_model_len=512",
        "--kv_cache_memory=64MiB",
        "--log_format=json"};
    if (role == "prefill")
      wargv.insert(wargv.end(), prefill_flags.begin(), prefill_flags.end());
    if (role == "decode")
      wargv.insert(wargv.end(), decode_flags.begin(), decode_flags.end());
    auto w = Subprocess::Start(wargv, tmp_ + "/" + role + ".log");
    if (!w.ok()) return std::string(w.status().message());
    (role == "decode" ? decode_ : prefill_) =
        std::make_unique<Subprocess>(std::move(*w));
  }
  decode_metrics_ = LoggedPort(*decode_, "worker serving", "metrics_port");
  decode_port_ = LoggedPort(*decode_, "worker serving", "grpc_port");
  prefill_metrics_ = LoggedPort(*prefill_, "worker serving", "metrics_port");
  if (decode_metrics_ == 0 || prefill_metrics_ == 0)
    return "no worker ports\n" + Logs();
  for (const char* role : {"prefill", "decode"}) {
    if (!WaitMetric(router_metrics_, "tandem_router_workers", {{"role", role}}, 1)) {
      return std::string(role) + " did not register\n" + Logs();
    }
  }
  stub_ = tandem::v1::Router::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(router_port_), grpc::InsecureChannelCredentials()));
  return "";
}

StreamResult ProcessCluster::Generate(const tandem::v1::GenerateRequest& req,
                                      std::function<void(int)> after_message) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60));
  return Drain(stub_->Generate(&ctx, req).get(), std::move(after_message));
}

StreamResult ProcessCluster::GenerateWithin(const tandem::v1::GenerateRequest& req,
                                            absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return Drain(stub_->Generate(&ctx, req).get());
}

std::vector<StreamResult> ProcessCluster::GenerateAll(
    const std::vector<tandem::v1::GenerateRequest>& reqs) {
  std::vector<std::future<StreamResult>> calls;
  for (const tandem::v1::GenerateRequest& r : reqs) {
    calls.push_back(std::async(std::launch::async, [this, &r] { return Generate(r); }));
  }
  std::vector<StreamResult> out;
  for (auto& f : calls) out.push_back(f.get());
  return out;
}

std::string ProcessCluster::Logs() const {
  std::string out;
  if (router_) out += "--- router\n" + router_->ReadLog();
  if (prefill_) out += "--- prefill\n" + prefill_->ReadLog();
  if (decode_) out += "--- decode\n" + decode_->ReadLog();
  return out;
}

}  // namespace tandem::testing
