#include "worker/worker_metrics.h"

#include <string>

#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "metrics/text_format.h"

namespace tandem::worker {
namespace {

TEST(WorkerMetricsTest, KvTransportInfoNamesWhatWasOpened) {
  metrics::Registry registry;
  WorkerMetrics m(&registry);
  // No series until the worker sets it.
  std::string text = metrics::SerializeText(registry.Collect());
  EXPECT_EQ(text.find("tandem_worker_kv_transport_info{"), std::string::npos) << text;
  m.SetKvTransport("libfabric", "tcp;ofi_rxm", 2);
  text = metrics::SerializeText(registry.Collect());
  EXPECT_NE(text.find("tandem_worker_kv_transport_info{agent=\"libfabric\","
                      "provider=\"tcp;ofi_rxm\",rails=\"2\"} 1"),
            std::string::npos)
      << text;
}

TEST(WorkerMetricsTest, KvPeerConnectionsCountedByTransports) {
  metrics::Registry registry;
  WorkerMetrics m(&registry);
  // Before any connection only the TCP-only and refused series are there, at
  // 0 (so that an alert's increase() sees the first one).
  std::string text = metrics::SerializeText(registry.Collect());
  EXPECT_NE(text.find("tandem_worker_kv_peer_connections_total{agent=\"ucx\","
                      "transports=\"tcp\",tcp_only=\"true\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("tcp_only=\"false\""), std::string::npos) << text;
  EXPECT_NE(text.find("tandem_worker_kv_peer_refused_total{agent=\"ucx\","
                      "transports=\"tcp\"} 0\n"),
            std::string::npos)
      << text;
  m.CountKvPeerConnection("ucx", "sysv,posix,cma", false);
  m.CountKvPeerConnection("ucx", "sysv,posix,cma", false);
  m.CountKvPeerConnection("ucx", "tcp", true);
  m.CountKvPeerConnection("ucx", "tcp", true, /*refused=*/true);
  m.CountKvPeerConnection("ucx", "", false);
  text = metrics::SerializeText(registry.Collect());
  EXPECT_NE(text.find("tandem_worker_kv_peer_refused_total{agent=\"ucx\","
                      "transports=\"tcp\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tandem_worker_kv_peer_connections_total{agent=\"ucx\","
                      "transports=\"sysv,posix,cma\",tcp_only=\"false\"} 2"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tandem_worker_kv_peer_connections_total{agent=\"ucx\","
                      "transports=\"tcp\",tcp_only=\"true\"} 2"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tandem_worker_kv_peer_connections_total{agent=\"ucx\","
                      "transports=\"unknown\",tcp_only=\"false\"} 1"),
            std::string::npos)
      << text;
}

TEST(WorkerMetricsTest, PrefixCacheTiers) {
  metrics::Registry registry;
  WorkerMetrics m(&registry);
  EngineLoopStats s;
  s.prefix.blocks_evicted = 7;
  s.prefix.snapshots_evicted = 2;
  s.prefix.host_blocks_evicted = 3;
  s.prefix.device_bytes_held = 4096;
  s.prefix.host_bytes_held = 1024;
  s.prefix.blocks_loaded_from_host = 5;
  s.prefix.snapshots_loaded_from_host = 1;
  s.prefix.hits_from_host = 1;
  s.prefix.host_budget_bytes = 1 << 20;
  m.Update(s, absl::Now());
  s.prefix.blocks_evicted = 9;  // counters follow the totals
  m.Update(s, absl::Now() + absl::Seconds(1));
  const std::string text = metrics::SerializeText(registry.Collect());
  for (const char* want : {
           "tandem_worker_prefix_cache_evictions_total{tier=\"device\",kind=\"block\"} "
           "9",
           "tandem_worker_prefix_cache_evictions_total{tier=\"device\",kind="
           "\"snapshot\"} 2",
           "tandem_worker_prefix_cache_evictions_total{tier=\"host\",kind=\"block\"} 3",
           "tandem_worker_prefix_cache_bytes{tier=\"device\"} 4096",
           "tandem_worker_prefix_cache_bytes{tier=\"host\"} 1024",
           "tandem_worker_prefix_cache_host_loads_total{kind=\"block\"} 5",
           "tandem_worker_prefix_cache_host_hits_total 1",
           "tandem_worker_prefix_cache_host_budget_bytes 1048576",
       }) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

// Sampled and scored rows by where: counters follow the engine's totals.
TEST(WorkerMetricsTest, SampledAndScoredRowsByWhere) {
  metrics::Registry registry;
  WorkerMetrics m(&registry);
  EngineLoopStats s;
  s.timing.device_sampled_rows = 10;
  s.timing.host_sampled_rows = 2;
  s.timing.device_scored_rows = 128;
  s.timing.host_scored_rows = 5;
  m.Update(s, absl::Now());
  s.timing.device_scored_rows = 150;
  m.Update(s, absl::Now() + absl::Seconds(1));
  const std::string text = metrics::SerializeText(registry.Collect());
  for (const char* want : {
           "tandem_worker_sampled_rows_total{where=\"device\"} 10",
           "tandem_worker_sampled_rows_total{where=\"host\"} 2",
           "tandem_worker_scored_prompt_rows_total{where=\"device\"} 150",
           "tandem_worker_scored_prompt_rows_total{where=\"host\"} 5",
       }) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

// Rank 0's collectives: counters follow the engine's totals, split by how the
// host waited for them.
TEST(WorkerMetricsTest, TensorParallelCollectives) {
  metrics::Registry registry;
  WorkerMetrics m(&registry);
  EngineLoopStats s;
  s.comm.calls = 40;
  s.comm.enqueued = 36;
  s.comm.bytes = 4096;
  s.comm.seconds = 0.5;
  s.comm.wait_seconds = 0.25;
  m.Update(s, absl::Now());
  s.comm.calls = 58;  // one more graph step: 18 enqueued, one wait
  s.comm.enqueued = 54;
  s.comm.bytes = 6144;
  s.comm.wait_seconds = 0.5;
  m.Update(s, absl::Now() + absl::Seconds(1));
  const std::string text = metrics::SerializeText(registry.Collect());
  for (const char* want : {
           "tandem_worker_tp_collectives_total{mode=\"waited\"} 4",
           "tandem_worker_tp_collectives_total{mode=\"stream_ordered\"} 54",
           "tandem_worker_tp_collective_bytes_total 6144",
           "tandem_worker_tp_collective_wait_seconds_total{wait=\"each\"} 0.5",
           "tandem_worker_tp_collective_wait_seconds_total{wait=\"step\"} 0.5",
       }) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

}  // namespace
}  // namespace tandem::worker
