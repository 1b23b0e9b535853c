// Reads the rules of a Prometheus rules file (deploy/monitoring/rules.yml) for
// tests: each rule's kind (record or alert), name and PromQL expression.
//
// Not a YAML parser: it reads the block style rules files are written in, one
// rule per `- record: NAME` / `- alert: NAME` item whose `expr:` is a plain
// one-line scalar, a single-quoted one, or a `|` / `>` block. Anything it cannot
// place (an expr outside a rule, a second expr, a rule without one, a
// double-quoted expr) is an error, and the test beside the real file checks that
// it finds as many rules as `promtool check rules` does.
#ifndef TANDEM_DEPLOY_MONITORING_RULES_FILE_H_
#define TANDEM_DEPLOY_MONITORING_RULES_FILE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::monitoring {

struct Rule {
  std::string kind;  // "record" or "alert"
  std::string name;
  std::string expr;
  int line = 0;  // 1-based line of the rule's first key
};

absl::StatusOr<std::vector<Rule>> ParseRules(absl::string_view yaml);

}  // namespace tandem::monitoring

#endif  // TANDEM_DEPLOY_MONITORING_RULES_FILE_H_
