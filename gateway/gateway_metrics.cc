#include "gateway/gateway_metrics.h"

#include <vector>

#include "metrics/buckets.h"

namespace tandem::gateway {
namespace {

std::vector<double> LatencyBuckets() {
  return *metrics::ExponentialBuckets(0.001, 2, 18);  // 1 ms .. ~131 s
}

}  // namespace

GatewayMetrics::GatewayMetrics(metrics::Registry* registry)
    : requests(metrics::OrDie(
          registry->AddCounter("tandem_gateway_requests_total",
                               "HTTP requests by endpoint and status code."))),
      latency(metrics::OrDie(registry->AddHistogram(
          "tandem_gateway_request_duration_seconds",
          "Time from request to the end of its response, by endpoint.",
          LatencyBuckets()))),
      ttft(metrics::OrDie(registry->AddHistogram(
          "tandem_gateway_time_to_first_token_seconds",
          "Time from request to the first generated token.", LatencyBuckets()))),
      active_streams(metrics::OrDie(registry->AddGauge(
          "tandem_gateway_active_streams", "SSE responses currently streaming."))),
      tokens(metrics::OrDie(
          registry->AddCounter("tandem_gateway_generated_tokens_total",
                               "Generated tokens received from the router."))) {
  active_streams->Add({}).Set(0);  // exported from the start
}

}  // namespace tandem::gateway
