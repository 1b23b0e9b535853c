#include "metrics/gauge.h"

namespace tandem::metrics {

void Gauge::Collect(MetricSnapshot* out) const { out->value = Value(); }

}  // namespace tandem::metrics
