// Every series the rules (rules.yml) and the Grafana dashboard (grafana/tandem.json)
// read exists in what the real processes export, with a type the expression uses
// correctly. Starts router_main + prefill_main + decode_main (tests/testing's
// ProcessCluster, tiny checkpoint, port 0) and gateway_main in front of them,
// sends gRPC and HTTP (streaming and not) requests, scrapes each /metrics, then
// for every selector in every expression checks that:
//   - a name with ':' is a recording rule defined in rules.yml;
//   - `up` is the only name not exported by a process (Prometheus makes it);
//   - any other name is a counter or gauge family some process exports, or the
//     _bucket/_sum/_count series of an exported histogram;
//   - counters and histogram series are read through rate/irate/increase, and
//     gauges never are;
//   - each label in the selector's matchers (other than the target labels the
//     scrape configs attach) is on some exported sample of that name.
// Renaming a metric or a label in the code fails this test until the rules and
// the dashboard follow. The router's end-to-end latency histogram must also have
// a sample per request sent (a registered, never observed one fails). It also checks
// that the dashboard takes its data source from a variable.
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "deploy/monitoring/promql_names.h"
#include "deploy/monitoring/rules_file.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process_cluster.h"
#include "tests/testing/subprocess.h"

namespace tandem::monitoring {
namespace {

using json = nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Expr {
  std::string where;  // e.g. "rules.yml alert TandemTargetDown"
  std::string text;
};

// Every PromQL expression of the dashboard's panels (rows included).
void DashboardExprs(const json& panels, std::vector<Expr>* out) {
  for (const json& p : panels) {
    if (p.contains("panels")) DashboardExprs(p["panels"], out);
    if (!p.contains("targets")) continue;
    for (const json& t : p["targets"]) {
      out->push_back({absl::StrCat("dashboard panel \"", p.value("title", ""), "\" ",
                                   t.value("refId", "")),
                      t.at("expr").get<std::string>()});
    }
  }
}

// What the processes export: family types, and the label names seen on each
// sample name.
struct Exposition {
  std::map<std::string, std::string> type;                     // family -> type
  std::map<std::string, std::set<std::string>> sample_labels;  // sample name -> labels
  std::map<std::string, metrics::ParsedText> texts;  // process -> its exposition

  void Add(const metrics::ParsedText& text) {
    for (const auto& [family, t] : text.type) type[family] = t;
    for (const metrics::ParsedSample& s : text.samples) {
      auto& labels = sample_labels[s.name];
      for (const auto& [k, v] : s.labels) labels.insert(k);
    }
  }
};

bool RateLike(const std::string& f) {
  return f == "rate" || f == "irate" || f == "increase";
}

// "" if `ref` is a correct use of what is exported, else what is wrong.
std::string Check(const SeriesRef& ref, const Exposition& ex,
                  const std::set<std::string>& recorded) {
  if (absl::StrContains(ref.name, ':')) {
    return recorded.count(ref.name) ? "" : "is no recording rule of rules.yml";
  }
  if (ref.name == "up") return "";
  std::string family = ref.name, type;
  if (auto it = ex.type.find(ref.name); it != ex.type.end()) {
    type = it->second;
    if (type == "histogram") {
      return "is a histogram: read its _bucket, _sum or _count series";
    }
  } else {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (!absl::EndsWith(ref.name, suffix)) continue;
      const std::string base = ref.name.substr(0, ref.name.size() - strlen(suffix));
      if (auto h = ex.type.find(base); h != ex.type.end() && h->second == "histogram") {
        family = base;
        type = "histogram";
      }
    }
  }
  if (type.empty()) return "is exported by no process";
  if ((type == "counter" || type == "histogram") && !RateLike(ref.function)) {
    return absl::StrCat("is a ", type, " series read through '", ref.function,
                        "' instead of rate/irate/increase");
  }
  if (type == "gauge" && RateLike(ref.function)) {
    return absl::StrCat("is a gauge read through ", ref.function);
  }
  static const std::set<std::string> kTargetLabels = {"job", "instance", "component",
                                                      "process", "namespace"};
  const auto labels = ex.sample_labels.find(ref.name);
  for (const std::string& l : ref.matcher_labels) {
    if (kTargetLabels.count(l)) continue;
    if (labels == ex.sample_labels.end() || !labels->second.count(l)) {
      return absl::StrCat("has no label '", l, "' on any exported sample");
    }
  }
  return "";
}

class MonitoringNamesTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << cluster_.Logs();
      if (gateway_) std::cerr << "--- gateway\n" << gateway_->ReadLog();
    }
  }

  // Starts gateway_main in front of the cluster's router; its HTTP port.
  int StartGateway() {
    auto gw = testing::Subprocess::Start(
        {testing::RunfilePath("gateway/gateway_main"),
         std::string("--model=") + testing::kTinyModel, "--port=0",
         "--router=127.0.0.1:" + std::to_string(cluster_.router_port()),
         "--log_format=json"},
        std::string(std::getenv("TEST_TMPDIR")) + "/gateway.log");
    if (!gw.ok()) return 0;
    gateway_ = std::make_unique<testing::Subprocess>(std::move(*gw));
    return testing::LoggedPort(*gateway_, "gateway serving", "port");
  }

  testing::ProcessCluster cluster_;
  std::unique_ptr<testing::Subprocess> gateway_;
};

TEST_F(MonitoringNamesTest, RulesAndDashboardReadOnlyExportedSeries) {
  // The expressions.
  auto rules = ParseRules(ReadFile("deploy/monitoring/rules.yml"));
  ASSERT_TRUE(rules.ok()) << rules.status();
  std::vector<Expr> exprs;
  std::set<std::string> recorded;
  for (const Rule& r : *rules) {
    exprs.push_back({absl::StrCat("rules.yml ", r.kind, " ", r.name), r.expr});
    if (r.kind == "record") recorded.insert(r.name);
  }
  const size_t rule_exprs = exprs.size();
  const json dash = json::parse(ReadFile("deploy/monitoring/grafana/tandem.json"),
                                nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(dash.is_discarded()) << "grafana/tandem.json is not JSON";
  DashboardExprs(dash.at("panels"), &exprs);
  ASSERT_GT(rule_exprs, 20u);
  ASSERT_GT(exprs.size() - rule_exprs, 30u);

  // The dashboard's data source is the `datasource` variable everywhere.
  ASSERT_GE(dash.value("schemaVersion", 0), 36);
  bool has_var = false;
  for (const json& v : dash["templating"]["list"]) {
    has_var |=
        v.value("name", "") == "datasource" && v.value("type", "") == "datasource";
  }
  EXPECT_TRUE(has_var) << "no datasource variable in templating";
  for (const json& p : dash["panels"]) {
    if (p.value("type", "") == "row") continue;
    EXPECT_EQ(p["datasource"]["uid"], "${datasource}") << p.value("title", "");
    for (const json& t : p["targets"]) {
      EXPECT_EQ(t["datasource"]["uid"], "${datasource}") << p.value("title", "");
    }
  }

  // The cluster, some traffic through the router and through the gateway.
  ASSERT_EQ(cluster_.Start({}, /*decode_slots=*/4), "");
  const int gateway_port = StartGateway();
  ASSERT_NE(gateway_port, 0) << "the gateway did not log its port";
  for (int i = 0; i < 3; ++i) {
    const testing::StreamResult r =
        cluster_.Generate(testing::MakeRequest(20 + 9 * i, 7 + i, 4, 0.0f));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.tokens.size(), 4u);
  }
  auto http =
      metrics::HttpConnection::Connect("127.0.0.1", gateway_port, absl::Seconds(30));
  ASSERT_TRUE(http.ok()) << http.status();
  auto models = (*http)->Get("/v1/models", absl::Seconds(30));
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->status_code, 200) << models->body;
  const std::string model = json::parse(models->body)["data"][0]["id"];
  const metrics::HttpHeaders headers = {{"Content-Type", "application/json"}};
  for (bool stream : {true, false}) {
    const json body = {{"model", model},
                       {"prompt", "The quick brown fox"},
                       {"max_tokens", 3},
                       {"temperature", 0},
                       {"stream", stream}};
    auto r = (*http)->Request("POST", "/v1/completions", headers, body.dump(),
                              absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 200) << r->body;
  }
  auto bad = (*http)->Request("POST", "/v1/completions", headers, "{not json",
                              absl::Seconds(30));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->status_code, 400) << bad->body;

  // Every process's exposition. Some families appear only once their first
  // sample is recorded, which can trail the response a client saw: scrape until
  // every selector resolves (bounded), then check the last scrape.
  const std::map<std::string, int> ports = {{"router", cluster_.router_metrics()},
                                            {"prefill", cluster_.prefill_metrics()},
                                            {"decode", cluster_.decode_metrics()},
                                            {"gateway", gateway_port}};
  std::vector<std::pair<const Expr*, SeriesRef>> refs;
  for (const Expr& e : exprs) {
    auto r = SeriesRefs(e.text);
    ASSERT_TRUE(r.ok()) << e.where << ": " << r.status();
    EXPECT_FALSE(r->empty()) << e.where << " reads no series: " << e.text;
    for (SeriesRef& ref : *r) refs.emplace_back(&e, std::move(ref));
  }
  ASSERT_GT(refs.size(), 100u);
  Exposition ex;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    ex = Exposition();
    for (const auto& [process, port] : ports) {
      auto get = metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(10));
      ASSERT_TRUE(get.ok()) << process << ": " << get.status();
      ASSERT_EQ(get->status_code, 200) << process;
      auto parsed = metrics::ParseText(get->body);
      ASSERT_TRUE(parsed.ok()) << process << ": " << parsed.status();
      ex.Add(*parsed);
      ex.texts[process] = std::move(*parsed);
    }
    bool all_resolve = true;
    for (const auto& [e, ref] : refs) all_resolve &= Check(ref, ex, recorded).empty();
    if (all_resolve || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  // The traffic went through a KV transfer and reached the gateway's counters.
  auto transfers =
      ex.texts["prefill"].Value("tandem_worker_transfers_total", {{"outcome", "ok"}});
  ASSERT_TRUE(transfers.ok()) << transfers.status();
  EXPECT_GE(*transfers, 1);
  EXPECT_EQ(ex.texts["gateway"].Find("tandem_gateway_requests_total").empty(), false);
  // The end-to-end latency the p50/p99 rules and the latency panel read has a
  // sample for every request the router ran (3 gRPC + 2 through the gateway,
  // all ok): a histogram that is registered but never observed fails here.
  auto duration_count =
      ex.texts["router"].Value("tandem_router_request_duration_seconds_count");
  ASSERT_TRUE(duration_count.ok()) << duration_count.status();
  EXPECT_GE(*duration_count, 5);
  auto router_ok =
      ex.texts["router"].Value("tandem_router_requests_total", {{"outcome", "ok"}});
  ASSERT_TRUE(router_ok.ok()) << router_ok.status();
  EXPECT_EQ(*duration_count, *router_ok);

  // Every selector of every expression.
  std::set<std::string> used;
  for (const auto& [e, ref] : refs) {
    used.insert(ref.name);
    const std::string problem = Check(ref, ex, recorded);
    EXPECT_EQ(problem, "") << e->where << ": '" << ref.name << "' " << problem
                           << "\n  in: " << e->text;
  }
  // Every recording rule is used by an alert or recorded for dashboards to read:
  // nothing to assert; list the exported families nothing reads, for the reader.
  std::vector<std::string> unread;
  for (const auto& [family, type] : ex.type) {
    const bool read = used.count(family) || used.count(family + "_bucket") ||
                      used.count(family + "_sum") || used.count(family + "_count");
    if (!read) unread.push_back(absl::StrCat(family, " (", type, ")"));
  }
  std::cerr << "exported families no rule or panel reads: "
            << (unread.empty() ? "none" : absl::StrJoin(unread, ", ")) << "\n";
}

}  // namespace
}  // namespace tandem::monitoring
