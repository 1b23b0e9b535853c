// The gateway's own metric families, registered once per OpenAIService in the
// registry that its /metrics shows. Endpoint labels are the route names
// ("chat_completions", "completions", "models", "health", "metrics", "other").
#ifndef TANDEM_GATEWAY_GATEWAY_METRICS_H_
#define TANDEM_GATEWAY_GATEWAY_METRICS_H_

#include "metrics/registry.h"

namespace tandem::gateway {

struct GatewayMetrics {
  // Not owned; must outlive the families' users.
  explicit GatewayMetrics(metrics::Registry* registry);
  metrics::Family<metrics::Counter>* requests;      // endpoint, status
  metrics::Family<metrics::Histogram>* latency;     // endpoint
  metrics::Family<metrics::Histogram>* ttft;        // endpoint
  metrics::Family<metrics::Gauge>* active_streams;  // no labels
  metrics::Family<metrics::Counter>* tokens;        // endpoint; generated tokens
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_GATEWAY_METRICS_H_
