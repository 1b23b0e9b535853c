#include "common/flag_names.h"

#include <algorithm>
#include <cstring>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace tandem {
namespace {

std::string Underscored(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

// One argument rewritten; *takes_next: it is a non-boolean flag without `=`,
// so the next argument is its value.
std::string NormalizeOne(const std::string& arg, bool* takes_next) {
  *takes_next = false;
  if (arg.size() < 2 || arg[0] != '-') return arg;
  const size_t dashes = arg[1] == '-' ? 2 : 1;
  const size_t eq = arg.find('=', dashes);
  const bool has_value = eq != std::string::npos;
  const absl::string_view name = absl::string_view(arg).substr(
      dashes, has_value ? eq - dashes : std::string::npos);
  const absl::string_view rest =
      has_value ? absl::string_view(arg).substr(eq) : absl::string_view();
  if (name.empty()) return arg;

  std::string resolved;
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag != nullptr) {
    resolved = std::string(name);
  } else if (absl::StrContains(name, '-') &&
             (flag = absl::FindCommandLineFlag(Underscored(name))) != nullptr) {
    resolved = Underscored(name);
  } else if (absl::StartsWith(name, "no")) {
    // --no-flag / --no_flag / --noflag: the negation of a boolean.
    absl::string_view base = name.substr(2);
    if (!base.empty() && (base[0] == '-' || base[0] == '_')) base.remove_prefix(1);
    const absl::CommandLineFlag* b = absl::FindCommandLineFlag(Underscored(base));
    if (b != nullptr && b->IsOfType<bool>()) return "--no" + Underscored(base);
    return arg;
  } else {
    return arg;
  }
  *takes_next = !has_value && !flag->IsOfType<bool>();
  return std::string(arg.substr(0, dashes)) + resolved + std::string(rest);
}

}  // namespace

std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i] == "--") break;
    bool takes_next = false;
    out[i] = NormalizeOne(out[i], &takes_next);
    if (takes_next) ++i;  // its value, whatever it looks like
  }
  return out;
}

void NormalizeFlagNames(int argc, char** argv) {
  const std::vector<std::string> in(argv, argv + argc);
  const std::vector<std::string> out = NormalizeFlagNames(in);
  for (int i = 0; i < argc; ++i) {
    if (out[i] != in[i]) std::memcpy(argv[i], out[i].c_str(), out[i].size() + 1);
  }
}

}  // namespace tandem
