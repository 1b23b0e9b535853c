#include "metrics/counter.h"

namespace tandem::metrics {

void Counter::Collect(MetricSnapshot* out) const { out->value = Value(); }

}  // namespace tandem::metrics
