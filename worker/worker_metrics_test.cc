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

}  // namespace
}  // namespace tandem::worker
