#include "deploy/monitoring/promql_names.h"

#include <cctype>
#include <initializer_list>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::monitoring {
namespace {

bool IdentStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}
bool IdentChar(char c) {
  return IdentStart(c) || std::isdigit(static_cast<unsigned char>(c));
}

bool In(const std::string& word, std::initializer_list<const char*> set) {
  for (const char* s : set) {
    if (word == s) return true;
  }
  return false;
}

class Lexer {
 public:
  explicit Lexer(absl::string_view s) : s_(s) {}

  absl::StatusOr<std::vector<SeriesRef>> Run() {
    while (true) {
      SkipSpace();
      if (i_ >= s_.size()) break;
      const char c = s_[i_];
      if (c == '"' || c == '\'' || c == '`') {
        TANDEM_RETURN_IF_ERROR(SkipString());
        pending_.clear();
      } else if (c == '#') {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else if (c == '$') {
        // A Grafana variable ($__rate_interval, ${datasource}).
        ++i_;
        if (i_ < s_.size() && s_[i_] == '{') {
          while (i_ < s_.size() && s_[i_] != '}') ++i_;
          ++i_;
        } else {
          while (i_ < s_.size() && IdentChar(s_[i_])) ++i_;
        }
        pending_.clear();
      } else if (std::isdigit(static_cast<unsigned char>(c)) ||
                 (c == '.' && i_ + 1 < s_.size() &&
                  std::isdigit(static_cast<unsigned char>(s_[i_ + 1])))) {
        SkipNumber();
        pending_.clear();
      } else if (IdentStart(c)) {
        TANDEM_RETURN_IF_ERROR(Identifier());
      } else if (c == '{') {
        return Error("a selector without a metric name");
      } else if (c == '[') {
        const size_t end = s_.find(']', i_);
        if (end == absl::string_view::npos) return Error("unterminated '['");
        i_ = end + 1;
        pending_.clear();
      } else if (c == '(') {
        stack_.push_back(pending_);
        pending_.clear();
        ++i_;
      } else if (c == ')') {
        if (stack_.empty()) return Error("unbalanced ')'");
        stack_.pop_back();
        pending_.clear();
        ++i_;
      } else if (c == '}' || c == ']') {
        return Error(absl::StrCat("unbalanced '", std::string(1, c), "'"));
      } else {
        pending_.clear();
        ++i_;
      }
    }
    if (!stack_.empty()) return Error("unbalanced '('");
    return std::move(refs_);
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return InvalidArgument("PromQL: ", what, " at offset ", i_, " in: ", s_);
  }

  void SkipSpace() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }

  char Peek() {
    SkipSpace();
    return i_ < s_.size() ? s_[i_] : '\0';
  }

  absl::Status SkipString() {
    const char quote = s_[i_++];
    while (i_ < s_.size() && s_[i_] != quote) {
      if (s_[i_] == '\\' && quote != '`') ++i_;
      ++i_;
    }
    if (i_ >= s_.size()) return Error("unterminated string");
    ++i_;
    return absl::OkStatus();
  }

  void SkipNumber() {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if ((c == 'e' || c == 'E') && i_ + 1 < s_.size() &&
          (s_[i_ + 1] == '+' || s_[i_ + 1] == '-')) {
        i_ += 2;
      } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '.') {
        ++i_;
      } else {
        break;
      }
    }
  }

  std::string ReadIdent() {
    const size_t start = i_;
    while (i_ < s_.size() && IdentChar(s_[i_])) ++i_;
    return std::string(s_.substr(start, i_ - start));
  }

  // The label list after by/without/on/ignoring/group_left/group_right.
  absl::Status SkipLabelList() {
    const size_t end = s_.find(')', i_);
    if (end == absl::string_view::npos) return Error("unterminated label list");
    i_ = end + 1;
    return absl::OkStatus();
  }

  absl::Status Matchers(SeriesRef& ref) {
    ++i_;  // '{'
    while (true) {
      const char c = Peek();
      if (c == '}') {
        ++i_;
        return absl::OkStatus();
      }
      if (!IdentStart(c)) return Error("expected a label name in a matcher");
      ref.matcher_labels.insert(ReadIdent());
      Peek();
      const size_t op = i_;
      while (i_ < s_.size() && (s_[i_] == '=' || s_[i_] == '!' || s_[i_] == '~')) ++i_;
      if (i_ == op) return Error("expected a matcher operator");
      const char q = Peek();
      if (q != '"' && q != '\'' && q != '`')
        return Error("expected a quoted label value");
      TANDEM_RETURN_IF_ERROR(SkipString());
      if (Peek() == ',') ++i_;
    }
  }

  absl::Status Identifier() {
    std::string word = ReadIdent();
    const std::string lower = absl::AsciiStrToLower(word);
    if (In(lower, {"by", "without", "on", "ignoring", "group_left", "group_right"})) {
      if (Peek() == '(') return SkipLabelList();
      return absl::OkStatus();
    }
    if (In(lower, {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})) {
      pending_.clear();
      return absl::OkStatus();
    }
    if (In(lower, {"sum", "avg", "count", "min", "max", "group", "stddev", "stdvar",
                   "topk", "bottomk", "quantile", "count_values"}) ||
        Peek() == '(') {
      pending_ = lower;
      return absl::OkStatus();
    }
    SeriesRef ref{.name = std::move(word)};
    for (auto it = stack_.rbegin(); it != stack_.rend(); ++it) {
      if (!it->empty()) {
        ref.function = *it;
        break;
      }
    }
    if (Peek() == '{') TANDEM_RETURN_IF_ERROR(Matchers(ref));
    refs_.push_back(std::move(ref));
    pending_.clear();
    return absl::OkStatus();
  }

  absl::string_view s_;
  size_t i_ = 0;
  std::string pending_;             // function or aggregation awaiting its '('
  std::vector<std::string> stack_;  // one entry per open '(' ("" for plain ones)
  std::vector<SeriesRef> refs_;
};

}  // namespace

absl::StatusOr<std::vector<SeriesRef>> SeriesRefs(absl::string_view expr) {
  return Lexer(expr).Run();
}

}  // namespace tandem::monitoring
