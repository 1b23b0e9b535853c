// The workers' prefix-cache hit counter, read from a ProcessCluster's /metrics
// (the cluster-level prefix-cache tests).
#ifndef TANDEM_TESTS_PREFIX_PREFIX_METRICS_H_
#define TANDEM_TESTS_PREFIX_PREFIX_METRICS_H_

#include <string>

#include "tests/testing/process_cluster.h"

namespace tandem::testing {

// Hit tokens over both workers (a prompt is computed by the prefill worker, or
// by the decode worker when colocated).
double PrefixHitTokens(ProcessCluster& c);

// The same once the workers' counters (refreshed every 500 ms) have settled:
// two equal readings 600 ms apart (bounded: 20 readings).
double SettledPrefixHitTokens(ProcessCluster& c);

// One counter of one /metrics endpoint (no labels), once two readings 600 ms
// apart agree (bounded: 20 readings); -1 while it cannot be read.
double SettledMetric(int port, const std::string& name);

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_PREFIX_PREFIX_METRICS_H_
