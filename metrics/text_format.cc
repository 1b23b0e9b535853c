#include "metrics/text_format.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace tandem::metrics {
namespace {

void AppendEscaped(absl::string_view s, bool escape_quote, std::string* out) {
  for (char c : s) {
    switch (c) {
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '"':
        if (escape_quote) {
          out->append("\\\"");
        } else {
          out->push_back(c);
        }
        break;
      default:
        out->push_back(c);
    }
  }
}

void AppendValue(double value, std::string* out) {
  if (std::isnan(value)) {
    out->append("NaN");
  } else if (std::isinf(value)) {
    out->append(value > 0 ? "+Inf" : "-Inf");
  } else if (value == std::trunc(value) && std::fabs(value) < 1e15) {
    // Integral and exactly representable in plain digits: no exponent.
    char buf[32];
    const int n = std::snprintf(buf, sizeof(buf), "%.0f", value);
    out->append(buf, n);
  } else {
    // Shortest representation that parses back to the same double.
    char buf[32];
    auto result = std::to_chars(buf, buf + sizeof(buf), value);
    out->append(buf, result.ptr - buf);
  }
}

void AppendLabels(const Labels& labels, absl::string_view le, std::string* out) {
  if (labels.empty() && le.empty()) return;
  out->push_back('{');
  bool first = true;
  for (const auto& [name, value] : labels) {
    if (!first) out->push_back(',');
    first = false;
    absl::StrAppend(out, name, "=\"");
    AppendEscaped(value, /*escape_quote=*/true, out);
    out->push_back('"');
  }
  if (!le.empty()) {
    if (!first) out->push_back(',');
    absl::StrAppend(out, "le=\"", le, "\"");
  }
  out->push_back('}');
}

void AppendSample(absl::string_view name, absl::string_view suffix,
                  const Labels& labels, absl::string_view le, double value,
                  std::string* out) {
  absl::StrAppend(out, name, suffix);
  AppendLabels(labels, le, out);
  out->push_back(' ');
  AppendValue(value, out);
  out->push_back('\n');
}

}  // namespace

std::string FormatValue(double value) {
  std::string out;
  AppendValue(value, &out);
  return out;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  AppendEscaped(help, /*escape_quote=*/false, &out);
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  AppendEscaped(value, /*escape_quote=*/true, &out);
  return out;
}

void AppendText(const std::vector<FamilySnapshot>& families, std::string* out) {
  for (const FamilySnapshot& family : families) {
    if (family.metrics.empty()) continue;
    absl::StrAppend(out, "# HELP ", family.name, " ");
    AppendEscaped(family.help, /*escape_quote=*/false, out);
    absl::StrAppend(out, "\n# TYPE ", family.name, " ", MetricTypeName(family.type),
                    "\n");
    for (const MetricSnapshot& m : family.metrics) {
      if (family.type != MetricType::kHistogram) {
        AppendSample(family.name, "", m.labels, "", m.value, out);
        continue;
      }
      for (const BucketSnapshot& bucket : m.buckets) {
        AppendSample(family.name, "_bucket", m.labels, FormatValue(bucket.upper_bound),
                     static_cast<double>(bucket.cumulative_count), out);
      }
      AppendSample(family.name, "_sum", m.labels, "", m.sum, out);
      AppendSample(family.name, "_count", m.labels, "", static_cast<double>(m.count),
                   out);
    }
  }
}

std::string SerializeText(const std::vector<FamilySnapshot>& families) {
  std::string out;
  AppendText(families, &out);
  return out;
}

}  // namespace tandem::metrics
