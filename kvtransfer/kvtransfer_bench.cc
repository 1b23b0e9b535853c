// kvtransfer_bench: bandwidth and latency of KV-state hand-offs between two
// processes on this host, against yardsticks measured in the same run.
//
//   bazel run //kvtransfer:kvtransfer_bench -- --contexts=32768,131072
//
// For each mode (shm: UCX's default transports into a receiver cache from
// UcxAgent::AllocateMemory; shm_mmap: the same into plain mmap memory; tcp:
// UCX_TLS=tcp with peer-failure detection) and each context length it writes a
// full-K3-shaped state (MLA: layers x tokens x 1152 bytes; KDA: layers x
// (96*128*128*4 + conv tails)) from this process into a transfer_peer child, one
// batch per layer. Each iteration times, one after the other, the agent and the
// yardsticks over exactly the same segments and memory (put_baselines.h): a plain
// UCP put loop, process_vm_writev (1 and --ceiling_threads threads) and memcpy
// into a local buffer (1 and N threads); after --warmup_iterations untimed
// iterations, medians and ranges of --iterations are reported. ucx_perftest
// ucp_put_bw as usual (one buffer of the largest segment's size, reused) runs
// after them. Ends with one JSON line {"bench":"kvtransfer",...}. Not part of the
// test suite.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/fabric_baseline.h"
#include "kvtransfer/libfabric_agent.h"
#include "kvtransfer/peer_process.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/put_baselines.h"
#include "kvtransfer/ucx_agent.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, contexts, "32768,131072",
          "Context lengths in tokens, comma separated");
ABSL_FLAG(int, mla_layers, 24, "MLA layers");
ABSL_FLAG(int, kda_layers, 69, "KDA layers");
ABSL_FLAG(int, src_block_size, 16, "Sender (prefill) block size");
ABSL_FLAG(int, dst_block_size, 64, "Receiver (decode) block size");
ABSL_FLAG(int, iterations, 3,
          "Timed transfers per configuration (best and median reported)");
ABSL_FLAG(int, warmup_iterations, 4,
          "Untimed transfers per configuration before the timed ones (the first "
          "passes over fresh memory are several times slower, see docs/kvtransfer.md); "
          "their times are reported as seconds_warmup");
ABSL_FLAG(int, latency_samples, 2000, "Small transfers timed for latency percentiles");
ABSL_FLAG(int, latency_bytes, 4096, "Bytes per small transfer");
ABSL_FLAG(std::string, transport, "ucx",
          "Which agents, when --modes is left at its default: ucx (shm,shm_mmap,tcp), "
          "libfabric (lf_tcp,lf_shm), both");
ABSL_FLAG(int, lf_max_iovs, 0,
          "libfabric modes: LibfabricAgentConfig.max_iovs_per_op of the sending agent "
          "(0: the provider's iov limits, consecutive pieces gathered into one "
          "fi_writemsg; 1: one fi_writemsg per piece, the agent before gathering)");
ABSL_FLAG(bool, scatter_blocks, false,
          "Shuffle both sides' block ids (fixed seed), as a long-running paged cache "
          "hands them out: segments stay one block each instead of coalescing into "
          "one per layer");
ABSL_FLAG(int, lf_rails, 1,
          "libfabric modes (lf_tcp, lf_shm): endpoints the agent stripes over");
ABSL_FLAG(std::string, modes, "shm,shm_mmap,tcp",
          "Transport settings to run: shm (UCX default transports, no peer failure "
          "detection, receiver cache from UcxAgent::AllocateMemory), shm_mmap (the "
          "same into plain mmap memory) and tcp (UCX_TLS=tcp, peer failure "
          "detection on, AllocateMemory); lf_tcp, lf_shm (LibfabricAgent on that "
          "provider, AllocateMemory, against a plain libfabric write loop)");
ABSL_FLAG(bool, huge_pages, false,
          "Back both sides' buffers with transparent huge pages (MADV_HUGEPAGE), as "
          "ucx_perftest's own buffers are; default: plain 4 KiB pages");
ABSL_FLAG(bool, bandwidth_protocols, true,
          "UcxAgentConfig.bandwidth_protocols (and the same flag on the plain UCP "
          "put loop): false reproduces the agent before it existed");
ABSL_FLAG(uint64_t, max_op_bytes, tandem::kvtransfer::UcxAgentConfig{}.max_op_bytes,
          "UcxAgentConfig.max_op_bytes of the sending agent");
ABSL_FLAG(bool, plain_put, true,
          "Also time a plain UCP put loop over the same segments and memory");
ABSL_FLAG(bool, cma_ceiling, true,
          "Also time process_vm_writev of the same segments (shm mode)");
ABSL_FLAG(int, ceiling_threads, 2,
          "Threads for the second process_vm_writev and memcpy ceilings (<= 1: "
          "only the single-threaded ones)");
ABSL_FLAG(bool, memcpy_ceiling, true,
          "Also time memcpy of the same segments into a local buffer of the "
          "receiver's size");
ABSL_FLAG(std::string, perftest, "/usr/bin/ucx_perftest",
          "ucx_perftest binary ('' to skip)");
ABSL_FLAG(std::string, peer_binary, "",
          "transfer_peer binary (default: next to this one)");

namespace tandem::kvtransfer {
namespace {

using nlohmann::json;

tandem::v1::KvLayout K3Layout(int block_size) {
  tandem::v1::KvLayout l;
  l.set_block_size(block_size);
  l.set_num_mla_layers(absl::GetFlag(FLAGS_mla_layers));
  l.set_num_kda_layers(absl::GetFlag(FLAGS_kda_layers));
  l.set_mla_token_bytes((512 + 64) * 2);
  l.set_kda_state_bytes(96LL * 128 * 128 * 4);
  l.set_kda_conv_bytes(3LL * 3 * 96 * 128 * 4);
  l.set_tp_size(1);
  l.set_mla_dtype("bf16");
  return l;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min<size_t>(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

constexpr int kPlainWindow = 128;               // as UcxAgentConfig's default
constexpr uint64_t kCeilingPiece = 4ull << 20;  // work unit of the copy ceilings

// Anonymous memory, optionally with transparent huge pages; unmapped on scope exit.
class Mapping {
 public:
  Mapping(uint64_t bytes, bool huge) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) return;
    if (huge) (void)madvise(p, bytes, MADV_HUGEPAGE);
    data_ = static_cast<uint8_t*>(p);
  }
  ~Mapping() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint64_t bytes_;
  uint8_t* data_ = nullptr;
};

struct Method {
  std::string name;
  std::function<absl::StatusOr<double>()> run;  // seconds for one pass
};

// Median, min and max GB/s of passes moving `bytes` each.
json RateSummary(uint64_t bytes, const std::vector<double>& seconds) {
  json x;
  x["seconds_each"] = seconds;
  if (seconds.empty()) return x;
  const double lo = *std::min_element(seconds.begin(), seconds.end());
  const double hi = *std::max_element(seconds.begin(), seconds.end());
  x["gb_per_s_median"] = bytes / Percentile(seconds, 0.5) / 1e9;
  x["gb_per_s_min"] = bytes / hi / 1e9;
  x["gb_per_s_max"] = bytes / lo / 1e9;
  return x;
}

// Runs ucx_perftest put bandwidth (server + client on loopback); MB/s overall.
double PerftestPutBandwidth(const std::string& tls, uint64_t message, int iters,
                            int warmup) {
  const std::string bin = absl::GetFlag(FLAGS_perftest);
  if (bin.empty() || access(bin.c_str(), X_OK) != 0) return 0;
  std::mt19937 rng(getpid() ^ static_cast<uint32_t>(absl::ToUnixMicros(absl::Now())));
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = 20000 + rng() % 30000;
    const std::string env = tls.empty() ? "" : absl::StrCat("UCX_TLS=", tls, " ");
    const std::string server = absl::StrCat(env, "timeout 120 ", bin, " -p ", port,
                                            " >/dev/null 2>&1 & echo $!");
    FILE* s = popen(server.c_str(), "r");
    char pid_buf[32] = {0};
    if (s == nullptr || fgets(pid_buf, sizeof(pid_buf), s) == nullptr) return 0;
    pclose(s);
    // The server needs a moment to listen: retry the client until a deadline.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::string out;
    while (absl::Now() < deadline) {
      const std::string client = absl::StrCat(
          env, "timeout 120 ", bin, " localhost -p ", port, " -t ucp_put_bw -s ",
          message, " -n ", iters, " -w ", warmup, " 2>&1");
      FILE* c = popen(client.c_str(), "r");
      if (c == nullptr) break;
      out.clear();
      char line[512];
      while (fgets(line, sizeof(line), c) != nullptr) out += line;
      pclose(c);
      if (absl::StrContains(out, "Final:")) break;
      absl::SleepFor(absl::Milliseconds(100));  // retry cadence for the server start
    }
    const std::string kill_cmd =
        absl::StrCat("kill ", std::string(pid_buf), " 2>/dev/null");
    if (std::system(kill_cmd.c_str()) != 0) {
      // Already exited after serving the client.
    }
    for (absl::string_view l : absl::StrSplit(out, '\n')) {
      if (!absl::StartsWith(l, "Final:")) continue;
      std::vector<absl::string_view> f = absl::StrSplit(l, ' ', absl::SkipEmpty());
      double mbs = 0;
      // Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall
      if (f.size() >= 7 && absl::SimpleAtod(f[6], &mbs))
        return mbs * 1.048576;  // MiB/s -> MB/s
    }
  }
  return 0;
}

struct ModeResult {
  json j;
};

json RunMode(const std::string& mode, const std::string& peer_binary) {
  // lf_<provider>: a LibfabricAgent on that provider (both sides), the receiver's
  // cache from AllocateMemory, against a plain libfabric write loop.
  const bool lf = absl::StartsWith(mode, "lf_");
  const std::string lf_provider = lf ? mode.substr(3) : "";
  const int lf_rails = absl::GetFlag(FLAGS_lf_rails);
  const bool tcp = mode == "tcp" || lf_provider == "tcp";
  const bool ucx_alloc = mode != "shm_mmap";
  if (mode != "tcp" && mode != "shm" && mode != "shm_mmap" && lf_provider != "tcp" &&
      lf_provider != "shm") {
    return json{{"mode", mode}, {"error", "unknown mode"}};
  }
  json out;
  out["mode"] = mode;
  if (lf) {
    out["transport_kind"] = "libfabric";
    out["libfabric_rails"] = lf_rails;
  }
  out["dst_alloc"] = ucx_alloc ? "UcxAgent::AllocateMemory" : "mmap";
  out["bandwidth_protocols"] = absl::GetFlag(FLAGS_bandwidth_protocols);
  out["ucx_tls"] = tcp ? "tcp" : "";
  out["peer_failure_detection"] = tcp;
  auto child = PeerProcess::Spawn(peer_binary);
  if (!child) {
    out["error"] = "spawn failed";
    return out;
  }
  std::string reply =
      child->Call(lf ? absl::StrCat("INIT libfabric ", lf_provider, " ", lf_rails)
                     : (tcp ? "INIT tcp" : "INIT - noerr"));
  if (reply != "OK") {
    out["error"] = reply;
    return out;
  }
  UcxAgentConfig config;
  config.tls = tcp ? "tcp" : "";
  config.peer_failure_detection = tcp;
  config.bandwidth_protocols = absl::GetFlag(FLAGS_bandwidth_protocols);
  config.max_op_bytes = absl::GetFlag(FLAGS_max_op_bytes);
  std::unique_ptr<TransferAgent> agent;
  if (lf) {
    LibfabricAgentConfig lc;
    lc.provider = lf_provider;
    lc.rails = lf_rails;
    lc.max_op_bytes = absl::GetFlag(FLAGS_max_op_bytes);
    lc.max_iovs_per_op = absl::GetFlag(FLAGS_lf_max_iovs);
    auto lf_or = LibfabricAgent::Create(lc);
    if (!lf_or.ok()) {
      out["error"] = lf_or.status().ToString();
      return out;
    }
    out["libfabric_mr_mode"] = (*lf_or)->mr_mode();
    out["libfabric_iov_limit"] = (*lf_or)->iov_limit();
    out["libfabric_rma_iov_limit"] = (*lf_or)->rma_iov_limit();
    agent = std::move(*lf_or);
  } else {
    auto agent_or = UcxAgent::Create(config);
    if (!agent_or.ok()) {
      out["error"] = agent_or.status().ToString();
      return out;
    }
    agent = std::move(*agent_or);
  }

  std::vector<int64_t> contexts;
  for (absl::string_view c :
       absl::StrSplit(absl::GetFlag(FLAGS_contexts), ',', absl::SkipEmpty())) {
    int64_t t = 0;
    if (absl::SimpleAtoi(c, &t) && t > 0) contexts.push_back(t);
  }
  const int64_t max_tokens = *std::max_element(contexts.begin(), contexts.end());
  const tandem::v1::KvLayout src_layout = K3Layout(absl::GetFlag(FLAGS_src_block_size));
  const tandem::v1::KvLayout dst_layout = K3Layout(absl::GetFlag(FLAGS_dst_block_size));
  const int64_t src_blocks =
      (max_tokens + src_layout.block_size() - 1) / src_layout.block_size();
  const int64_t dst_blocks =
      (max_tokens + dst_layout.block_size() - 1) / dst_layout.block_size();

  reply = child->Call(
      absl::StrCat("LAYOUT ", absl::BytesToHexString(dst_layout.SerializeAsString()),
                   " ", dst_blocks, " 1",
                   ucx_alloc                         ? " ucx"
                   : absl::GetFlag(FLAGS_huge_pages) ? " huge"
                                                     : ""),
      absl::Seconds(120));
  if (!absl::StartsWith(reply, "OK ")) {
    out["error"] = reply;
    return out;
  }
  std::vector<std::string> w = absl::StrSplit(reply, ' ');
  uint32_t dst_region = 0;
  (void)absl::SimpleAtoi(w[1], &dst_region);
  const std::string desc_reply = child->Call("DESC");
  if (!absl::StartsWith(desc_reply, "DESC ")) {
    out["error"] = desc_reply;
    return out;
  }
  auto peer = agent->Connect(absl::HexStringToBytes(desc_reply.substr(5)));
  if (!peer.ok()) {
    out["error"] = peer.status().ToString();
    return out;
  }
  const uint64_t src_bytes = ContiguousRegionBytes(src_layout, src_blocks, 1);
  const bool huge = absl::GetFlag(FLAGS_huge_pages);
  Mapping src_map(src_bytes, huge);
  uint8_t* mem = src_map.data();
  if (mem == nullptr) {
    out["error"] = "mmap of the source failed";
    return out;
  }
  for (size_t i = 0; i < src_bytes; i += 4096) mem[i] = static_cast<uint8_t>(i >> 12);
  auto src_region = agent->RegisterMemory(mem, src_bytes);
  if (!src_region.ok()) {
    out["error"] = src_region.status().ToString();
    return out;
  }
  out["transport"] = agent->Transport(*peer);
  out["huge_pages"] = huge;
  const std::string descriptor = absl::HexStringToBytes(desc_reply.substr(5));
  const AgentDescriptor parsed = *ParseDescriptor(descriptor);
  const RegionDescriptor* dst_desc = parsed.FindRegion(dst_region);
  const uint64_t dst_base = dst_desc == nullptr ? 0 : dst_desc->base;
  const uint64_t dst_bytes = dst_desc == nullptr ? 0 : dst_desc->length;

  // Yardsticks (put_baselines.h): a plain UCP put loop with the agent's UCX
  // settings, process_vm_writev, memcpy into a local buffer as big as the
  // receiver's region.
  std::unique_ptr<PlainUcpPut> plain;
  std::unique_ptr<PlainFabricWrite> plain_fi;
  if (absl::GetFlag(FLAGS_plain_put) && lf) {
    auto p =
        PlainFabricWrite::Create(lf_provider, descriptor, dst_region, mem, src_bytes);
    if (p.ok()) {
      plain_fi = *std::move(p);
    } else {
      out["plain_fi_write_error"] = p.status().ToString();
    }
  } else if (absl::GetFlag(FLAGS_plain_put)) {
    std::vector<std::pair<std::string, std::string>> options;
    if (std::getenv("UCX_PROTO_ENABLE") == nullptr)
      options.emplace_back("PROTO_ENABLE", "y");  // as UcxAgentConfig.use_proto_v2
    if (tcp) options.emplace_back("TLS", "tcp");
    auto p = PlainUcpPut::Create(options, descriptor, dst_region, mem, src_bytes);
    if (p.ok()) {
      plain = *std::move(p);
    } else {
      out["plain_ucp_put_error"] = p.status().ToString();
    }
  }
  std::unique_ptr<Mapping> local_map;
  uint8_t* local_dst = nullptr;
  if (absl::GetFlag(FLAGS_memcpy_ceiling) && dst_bytes > 0) {
    local_map = std::make_unique<Mapping>(dst_bytes, huge);
    local_dst = local_map->data();
    if (local_dst != nullptr) std::memset(local_dst, 0, dst_bytes);
  }

  json runs = json::array();
  for (int64_t tokens : contexts) {
    RankLayout src = ContiguousRankLayout(src_layout, src_blocks, 1, *src_region);
    RankLayout dst = ContiguousRankLayout(dst_layout, dst_blocks, 1, dst_region);
    for (int64_t b = 0; b * src_layout.block_size() < tokens; ++b)
      src.block_ids.push_back(b);
    for (int64_t b = 0; b * dst_layout.block_size() < tokens; ++b)
      dst.block_ids.push_back(b);
    if (absl::GetFlag(FLAGS_scatter_blocks)) {
      std::mt19937 rng(7);
      std::shuffle(src.block_ids.begin(), src.block_ids.end(), rng);
      std::shuffle(dst.block_ids.begin(), dst.block_ids.end(), rng);
    }
    std::vector<TransferPlan> plans;
    int64_t raw = 0, coalesced = 0;
    uint64_t bytes = 0, largest = 0;
    for (int l = 0; l < src_layout.num_mla_layers() + src_layout.num_kda_layers();
         ++l) {
      const LayerRef layer =
          l < src_layout.num_mla_layers()
              ? LayerRef{LayerKind::kMla, l}
              : LayerRef{LayerKind::kKda, l - src_layout.num_mla_layers()};
      auto plan = PlanLayer(src, dst, layer, tokens);
      if (!plan.ok()) {
        out["error"] = plan.status().ToString();
        return out;
      }
      raw += plan->segments_before_coalescing;
      coalesced += plan->segments.size();
      bytes += plan->bytes;
      for (const Segment& s : plan->segments) largest = std::max(largest, s.length);
      plans.push_back(*std::move(plan));
    }
    // The same bytes as flat (source offset, destination offset, length) triples
    // for the yardsticks; the agent's segments are per layer.
    std::vector<CopySegment> flat;
    for (const TransferPlan& p : plans) {
      for (const Segment& s : p.segments)
        flat.push_back({s.local_offset, s.remote_offset, s.length});
    }
    // Every method moves the same bytes between the same buffers; one pass of
    // each in turn per iteration, so machine load hits them alike.
    std::vector<Method> methods;
    methods.push_back({"agent", [&]() -> absl::StatusOr<double> {
                         const absl::Time t0 = absl::Now();
                         std::vector<BatchId> batches;
                         for (const TransferPlan& p : plans) {
                           auto b = agent->PostWrite(*peer, p.segments);
                           if (!b.ok()) return b.status();
                           batches.push_back(*b);
                         }
                         absl::Status first;
                         for (BatchId b : batches) {
                           absl::Status st =
                               agent->Wait(b, absl::Now() + absl::Seconds(300));
                           if (first.ok()) first = st;
                         }
                         if (!first.ok()) return first;
                         return absl::ToDoubleSeconds(absl::Now() - t0);
                       }});
    if (plain_fi != nullptr) {
      methods.push_back({"plain_fi_write", [&]() -> absl::StatusOr<double> {
                           return plain_fi->Run(flat,
                                                LibfabricAgentConfig{}.max_inflight_ops,
                                                absl::GetFlag(FLAGS_max_op_bytes), 300);
                         }});
    }
    if (plain != nullptr) {
      methods.push_back({"plain_ucp_put", [&]() -> absl::StatusOr<double> {
                           return plain->Run(flat, kPlainWindow,
                                             absl::GetFlag(FLAGS_bandwidth_protocols),
                                             300);
                         }});
    }
    if (!tcp && absl::GetFlag(FLAGS_cma_ceiling)) {
      methods.push_back({"cma_1thread", [&]() -> absl::StatusOr<double> {
                           return CmaCopy(child->pid(), mem, dst_base, flat, 1,
                                          kCeilingPiece);
                         }});
      const int threads = absl::GetFlag(FLAGS_ceiling_threads);
      if (threads > 1) {
        methods.push_back({absl::StrCat("cma_", threads, "threads"),
                           [&, threads]() -> absl::StatusOr<double> {
                             return CmaCopy(child->pid(), mem, dst_base, flat, threads,
                                            kCeilingPiece);
                           }});
      }
    }
    if (local_dst != nullptr) {
      methods.push_back({"memcpy_1thread", [&]() -> absl::StatusOr<double> {
                           return MemcpyCopy(mem, local_dst, flat, 1, kCeilingPiece);
                         }});
      const int threads = absl::GetFlag(FLAGS_ceiling_threads);
      if (threads > 1) {
        methods.push_back({absl::StrCat("memcpy_", threads, "threads"),
                           [&, threads]() -> absl::StatusOr<double> {
                             return MemcpyCopy(mem, local_dst, flat, threads,
                                               kCeilingPiece);
                           }});
      }
    }
    std::vector<std::vector<double>> timed(methods.size()), warm(methods.size());
    std::string error;
    const int warmup = absl::GetFlag(FLAGS_warmup_iterations);
    for (int it = 0; it < warmup + absl::GetFlag(FLAGS_iterations) && error.empty();
         ++it) {
      // Every other iteration in reverse order, so no method always runs right
      // after the same neighbour.
      for (size_t k = 0; k < methods.size(); ++k) {
        const size_t m = it % 2 == 0 ? k : methods.size() - 1 - k;
        absl::StatusOr<double> sec = methods[m].run();
        if (!sec.ok()) {
          error = absl::StrCat(methods[m].name, ": ", sec.status().ToString());
          break;
        }
        (it < warmup ? warm : timed)[m].push_back(*sec);
      }
    }
    json r;
    r["tokens"] = tokens;
    r["bytes"] = bytes;
    r["segments_before_coalescing"] = raw;
    r["segments_after_coalescing"] = coalesced;
    r["largest_segment_bytes"] = largest;
    if (!error.empty()) r["error"] = error;
    json by_method = json::object();
    std::map<std::string, double> median_gbs;
    for (size_t m = 0; m < methods.size(); ++m) {
      json x = RateSummary(bytes, timed[m]);
      x["seconds_warmup"] = warm[m];
      if (!warm[m].empty()) x["gb_per_s_first"] = bytes / warm[m][0] / 1e9;
      median_gbs[methods[m].name] = x.value("gb_per_s_median", 0.0);
      by_method[methods[m].name] = x;
    }
    r["methods"] = by_method;
    const double agent_gbs = median_gbs["agent"];
    r["gb_per_s"] = agent_gbs;
    // ucx_perftest as usual: the same transports, the plan's largest segment
    // (capped to keep the run short) as message size, one buffer reused, about
    // 2 GB moved.
    const uint64_t message = std::min<uint64_t>(largest, 64ull << 20);
    const int iters = static_cast<int>(std::max<uint64_t>(8, (2ull << 30) / message));
    // Warm-up iterations moving as many bytes as the agent's warm-up passes.
    // Not over tcp, where perftest's put_bw moves only tens of MB/s.
    const int perf_warmup =
        tcp ? 0
            : static_cast<int>(std::min<uint64_t>(
                  1000, std::max<uint64_t>(8, warmup * bytes / message)));
    const double perf_mbs =
        lf ? 0 : PerftestPutBandwidth(tcp ? "tcp" : "", message, iters, perf_warmup);
    r["perftest_message_bytes"] = message;
    r["perftest_gb_per_s"] = perf_mbs / 1e3;
    r["ratio_vs_perftest"] = perf_mbs > 0 ? agent_gbs / (perf_mbs / 1e3) : 0;
    auto ratio_to = [&](const std::string& name) {
      auto it = median_gbs.find(name);
      return it == median_gbs.end() || it->second <= 0 ? 0.0 : agent_gbs / it->second;
    };
    r["ratio_vs_plain_ucp_put"] = ratio_to("plain_ucp_put");
    r["ratio_vs_plain_fi_write"] = ratio_to("plain_fi_write");
    r["ratio_vs_cma_1thread"] = ratio_to("cma_1thread");
    r["ratio_vs_memcpy_1thread"] = ratio_to("memcpy_1thread");
    std::cerr << mode << " " << tokens << " tokens, " << bytes / 1e9 << " GB, segments "
              << raw << " -> " << coalesced << "; median GB/s [min-max]:";
    for (size_t m = 0; m < methods.size(); ++m) {
      const json& x = by_method[methods[m].name];
      std::cerr << " " << methods[m].name << " " << x.value("gb_per_s_median", 0.0)
                << " [" << x.value("gb_per_s_min", 0.0) << "-"
                << x.value("gb_per_s_max", 0.0) << "]";
    }
    std::cerr
        << "; ucx_perftest (one " << message << "-byte buffer) " << perf_mbs / 1e3
        << "; agent/plain "
        << r[lf ? "ratio_vs_plain_fi_write" : "ratio_vs_plain_ucp_put"].get<double>()
        << ", agent/perftest " << r["ratio_vs_perftest"].get<double>()
        << (error.empty() ? "" : " ERROR " + error) << "\n";
    runs.push_back(r);
  }
  out["runs"] = runs;

  // Small-transfer latency: one segment written and waited for, end to end.
  const int samples = absl::GetFlag(FLAGS_latency_samples);
  const uint64_t small = absl::GetFlag(FLAGS_latency_bytes);
  std::vector<double> us;
  for (int i = 0; i < samples; ++i) {
    const absl::Time t0 = absl::Now();
    auto b = agent->PostWrite(*peer,
                              {{*src_region, 0, dst_region, (i % 64) * small, small}});
    if (!b.ok() || !agent->Wait(*b, absl::Now() + absl::Seconds(10)).ok()) break;
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  out["latency_bytes"] = small;
  out["latency_p50_us"] = Percentile(us, 0.5);
  out["latency_p99_us"] = Percentile(us, 0.99);
  plain.reset();
  plain_fi.reset();
  (void)agent->Disconnect(*peer);
  (void)agent->DeregisterMemory(*src_region);
  return out;
}

}  // namespace
}  // namespace tandem::kvtransfer

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "kvtransfer_bench",
      "Two-process KV-state transfer bandwidth and latency vs ucx_perftest.");
  std::string peer = absl::GetFlag(FLAGS_peer_binary);
  if (peer.empty()) {
    std::string self = argv[0];
    const size_t slash = self.rfind('/');
    peer = (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) +
           "/transfer_peer";
  }
  nlohmann::json result;
  result["bench"] = "kvtransfer";
  result["mla_layers"] = absl::GetFlag(FLAGS_mla_layers);
  result["kda_layers"] = absl::GetFlag(FLAGS_kda_layers);
  result["src_block_size"] = absl::GetFlag(FLAGS_src_block_size);
  result["dst_block_size"] = absl::GetFlag(FLAGS_dst_block_size);
  nlohmann::json modes = nlohmann::json::array();
  std::string mode_list = absl::GetFlag(FLAGS_modes);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (mode_list == "shm,shm_mmap,tcp") {  // the default: --transport picks
    if (transport == "libfabric") mode_list = "lf_tcp,lf_shm";
    if (transport == "both") mode_list = "lf_tcp,lf_shm,tcp,shm,shm_mmap";
  }
  for (absl::string_view m : absl::StrSplit(mode_list, ',', absl::SkipEmpty())) {
    modes.push_back(tandem::kvtransfer::RunMode(std::string(m), peer));
  }
  result["modes"] = modes;
  std::cout << result.dump() << std::endl;
  return 0;
}
