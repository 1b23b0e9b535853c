#include "metrics/text_parse.h"

#include <charconv>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::metrics {
namespace {

bool IsBlank(char c) { return c == ' ' || c == '\t'; }

bool IsMetricNameStart(char c) {
  return absl::ascii_isalpha(c) || c == '_' || c == ':';
}
bool IsMetricNameChar(char c) { return IsMetricNameStart(c) || absl::ascii_isdigit(c); }
bool IsLabelNameStart(char c) { return absl::ascii_isalpha(c) || c == '_'; }
bool IsLabelNameChar(char c) { return IsLabelNameStart(c) || absl::ascii_isdigit(c); }

// A cursor over one line.
class LineReader {
 public:
  explicit LineReader(absl::string_view line) : line_(line) {}

  bool AtEnd() const { return pos_ >= line_.size(); }
  char Peek() const { return line_[pos_]; }
  void Advance() { ++pos_; }
  // Returns how many blanks were skipped.
  size_t SkipBlanks() {
    const size_t begin = pos_;
    while (!AtEnd() && IsBlank(Peek())) ++pos_;
    return pos_ - begin;
  }
  absl::string_view Rest() const { return line_.substr(pos_); }

  absl::string_view ReadWhile(bool (*start)(char), bool (*rest)(char)) {
    const size_t begin = pos_;
    if (AtEnd() || !start(Peek())) return {};
    ++pos_;
    while (!AtEnd() && rest(Peek())) ++pos_;
    return line_.substr(begin, pos_ - begin);
  }
  absl::string_view ReadToken() {
    const size_t begin = pos_;
    while (!AtEnd() && !IsBlank(Peek())) ++pos_;
    return line_.substr(begin, pos_ - begin);
  }

 private:
  absl::string_view line_;
  size_t pos_ = 0;
};

absl::Status LineError(int line_number, absl::string_view what,
                       absl::string_view line) {
  constexpr size_t kMaxShown = 120;
  std::string shown(line.substr(0, kMaxShown));
  if (line.size() > kMaxShown) shown += "...";
  return absl::InvalidArgumentError(absl::StrCat("metrics text line ", line_number,
                                                 ": ", what, ": \"",
                                                 absl::CHexEscape(shown), "\""));
}

// HELP text: `\\` and `\n` are escapes; any other backslash is kept as written.
std::string UnescapeHelp(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == '\\' || s[i + 1] == 'n')) {
      out.push_back(s[i + 1] == 'n' ? '\n' : '\\');
      ++i;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// Reads a quoted label value (the reader is on the opening quote).
absl::StatusOr<std::string> ReadQuoted(LineReader& r) {
  r.Advance();  // opening quote
  std::string out;
  while (true) {
    if (r.AtEnd()) return absl::InvalidArgumentError("unterminated label value");
    const char c = r.Peek();
    r.Advance();
    if (c == '"') return out;
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (r.AtEnd())
      return absl::InvalidArgumentError("unterminated escape in label value");
    const char e = r.Peek();
    r.Advance();
    switch (e) {
      case '\\':
        out.push_back('\\');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'n':
        out.push_back('\n');
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("invalid escape \\", std::string(1, e), " in label value"));
    }
  }
}

absl::Status ParseLabels(LineReader& r, std::map<std::string, std::string>* labels) {
  r.Advance();  // '{'
  while (true) {
    r.SkipBlanks();
    if (r.AtEnd()) return absl::InvalidArgumentError("unterminated label set");
    if (r.Peek() == '}') {
      r.Advance();
      return absl::OkStatus();
    }
    absl::string_view name = r.ReadWhile(IsLabelNameStart, IsLabelNameChar);
    if (name.empty()) return absl::InvalidArgumentError("expected a label name");
    r.SkipBlanks();
    if (r.AtEnd() || r.Peek() != '=') {
      return absl::InvalidArgumentError(
          absl::StrCat("expected '=' after label ", name));
    }
    r.Advance();
    r.SkipBlanks();
    if (r.AtEnd() || r.Peek() != '"') {
      return absl::InvalidArgumentError(
          absl::StrCat("expected '\"' to open the value of label ", name));
    }
    absl::StatusOr<std::string> value = ReadQuoted(r);
    if (!value.ok()) return value.status();
    if (!labels->emplace(std::string(name), *std::move(value)).second) {
      return absl::InvalidArgumentError(absl::StrCat("label ", name, " appears twice"));
    }
    r.SkipBlanks();
    if (r.AtEnd()) return absl::InvalidArgumentError("unterminated label set");
    if (r.Peek() == ',') {
      r.Advance();
    } else if (r.Peek() != '}') {
      return absl::InvalidArgumentError("expected ',' or '}' after a label value");
    }
  }
}

absl::Status ParseComment(absl::string_view line, ParsedText* out) {
  LineReader r(line);
  r.SkipBlanks();
  r.Advance();  // '#'
  r.SkipBlanks();
  const absl::string_view keyword = r.ReadToken();
  if (keyword != "HELP" && keyword != "TYPE") return absl::OkStatus();  // plain comment
  r.SkipBlanks();
  const absl::string_view name = r.ReadWhile(IsMetricNameStart, IsMetricNameChar);
  if (name.empty() || (!r.AtEnd() && !IsBlank(r.Peek()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid metric name after ", keyword));
  }
  if (keyword == "HELP") {
    if (!r.AtEnd()) r.Advance();  // the one separating blank; the rest is the text
    if (!out->help.emplace(std::string(name), UnescapeHelp(r.Rest())).second) {
      return absl::InvalidArgumentError(absl::StrCat("second HELP line for ", name));
    }
    return absl::OkStatus();
  }
  r.SkipBlanks();
  const absl::string_view type = r.ReadToken();
  r.SkipBlanks();
  if (!r.AtEnd()) return absl::InvalidArgumentError("trailing text after TYPE");
  if (type != "counter" && type != "gauge" && type != "histogram" &&
      type != "summary" && type != "untyped") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown metric type \"", type, "\""));
  }
  if (!out->type.emplace(std::string(name), std::string(type)).second) {
    return absl::InvalidArgumentError(absl::StrCat("second TYPE line for ", name));
  }
  return absl::OkStatus();
}

absl::StatusOr<ParsedSample> ParseSample(absl::string_view line) {
  LineReader r(line);
  r.SkipBlanks();
  ParsedSample sample;
  const absl::string_view name = r.ReadWhile(IsMetricNameStart, IsMetricNameChar);
  if (name.empty()) return absl::InvalidArgumentError("expected a metric name");
  sample.name = std::string(name);
  bool blank_before_value = r.SkipBlanks() > 0;
  if (!r.AtEnd() && r.Peek() == '{') {
    if (absl::Status s = ParseLabels(r, &sample.labels); !s.ok()) return s;
    blank_before_value = r.SkipBlanks() > 0;
  }
  if (r.AtEnd()) return absl::InvalidArgumentError("missing value");
  if (!blank_before_value) {
    return absl::InvalidArgumentError("expected a blank before the value");
  }
  const absl::string_view value_token = r.ReadToken();
  std::optional<double> value = ParseValue(value_token);
  if (!value) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid value \"", absl::CHexEscape(value_token), "\""));
  }
  sample.value = *value;
  r.SkipBlanks();
  if (!r.AtEnd()) {
    absl::string_view ts = r.ReadToken();
    int64_t ms = 0;
    auto [ptr, ec] = std::from_chars(ts.data(), ts.data() + ts.size(), ms);
    if (ec != std::errc() || ptr != ts.data() + ts.size() || ts.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid timestamp \"", absl::CHexEscape(ts), "\""));
    }
    sample.timestamp_ms = ms;
    r.SkipBlanks();
    if (!r.AtEnd())
      return absl::InvalidArgumentError("trailing text after the timestamp");
  }
  return sample;
}

}  // namespace

std::optional<double> ParseValue(absl::string_view token) {
  if (token.empty()) return std::nullopt;
  absl::string_view body = token;
  bool negative = false;
  if (body[0] == '+' || body[0] == '-') {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (absl::EqualsIgnoreCase(body, "inf") || absl::EqualsIgnoreCase(body, "infinity")) {
    const double inf = std::numeric_limits<double>::infinity();
    return negative ? -inf : inf;
  }
  if (absl::EqualsIgnoreCase(body, "nan")) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (body.empty() || !(absl::ascii_isdigit(body[0]) || body[0] == '.')) {
    return std::nullopt;  // no second sign, no letters
  }
  double value = 0;
  auto [ptr, ec] = std::from_chars(body.data(), body.data() + body.size(), value,
                                   std::chars_format::general);
  if (ptr != body.data() + body.size()) return std::nullopt;
  if (ec == std::errc::result_out_of_range) {
    // Overflow to infinity or underflow to zero, as strtod would give.
    return std::nullopt;
  }
  if (ec != std::errc()) return std::nullopt;
  return negative ? -value : value;
}

absl::StatusOr<ParsedText> ParseText(absl::string_view text) {
  ParsedText out;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(line);
    if (trimmed.empty()) continue;
    if (trimmed[0] == '#') {
      if (absl::Status s = ParseComment(line, &out); !s.ok()) {
        return LineError(line_number, s.message(), line);
      }
      continue;
    }
    absl::StatusOr<ParsedSample> sample = ParseSample(line);
    if (!sample.ok()) return LineError(line_number, sample.status().message(), line);
    out.samples.push_back(*std::move(sample));
  }
  return out;
}

absl::StatusOr<double> ParsedText::Value(
    absl::string_view name, const std::map<std::string, std::string>& labels) const {
  for (const ParsedSample& sample : samples) {
    if (sample.name == name && sample.labels == labels) return sample.value;
  }
  std::string wanted(name);
  for (const auto& [k, v] : labels) absl::StrAppend(&wanted, " ", k, "=", v);
  return absl::NotFoundError(absl::StrCat("no sample ", wanted));
}

std::vector<const ParsedSample*> ParsedText::Find(absl::string_view name) const {
  std::vector<const ParsedSample*> found;
  for (const ParsedSample& sample : samples) {
    if (sample.name == name) found.push_back(&sample);
  }
  return found;
}

}  // namespace tandem::metrics
