#include "common/init.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/synchronization/mutex.h"
#include "common/flag_names.h"
#include "common/logging.h"

ABSL_FLAG(std::string, log_format, "text", "Log line format: text or json.");
ABSL_FLAG(std::string, log_level, "info",
          "Lowest level logged: debug, info, warning or error.");
ABSL_FLAG(std::string, log_process, "",
          "Process name shown on each log line (default: the program's own).");

namespace tandem {
namespace {

bool IsHelpFlag(absl::string_view arg) {
  for (absl::string_view h :
       {"--help", "-help", "--helpfull", "-helpfull", "--helpshort", "-helpshort"}) {
    if (arg == h) return true;
  }
  return false;
}

std::string Hyphenated(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

// --help, --helpfull and --helpshort: the usage message and every Tandem flag
// (not Abseil's internals), by the file that defines it, spelled with hyphens as
// users type them (the underscored spelling is the same flag).
void PrintHelpAndExit(absl::string_view usage) {
  std::map<std::string, std::vector<const absl::CommandLineFlag*>> by_file;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->IsRetired()) continue;
    const std::string file(flag->Filename());
    if (file.find("absl/") != std::string::npos) continue;
    by_file[file].push_back(flag);
  }
  std::string out(usage);
  if (!out.empty() && out.back() != '\n') out += '\n';
  out +=
      "\nFlags (--flag-name and --flag_name are the same flag; --flag=value or "
      "--flag value):\n";
  for (auto& [file, flags] : by_file) {
    std::sort(flags.begin(), flags.end(),
              [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
                return a->Name() < b->Name();
              });
    out += "\n  from " + file + ":\n";
    for (const absl::CommandLineFlag* f : flags) {
      const bool boolean = f->IsOfType<bool>();
      out += "    --" + std::string(boolean ? "[no-]" : "") + Hyphenated(f->Name());
      out += "  " + f->Help();
      const std::string def = f->DefaultValue();
      out += f->IsOfType<std::string>() ? " (default: \"" + def + "\")"
                                        : " (default: " + def + ")";
      out += "\n";
    }
  }
  // The usage message and the help texts name flags too ("[--metrics_port=N]"):
  // every --name of a known flag in them is spelled with hyphens as well.
  const auto flags = absl::GetAllFlags();
  std::string text;
  for (size_t i = 0; i < out.size();) {
    if (out.compare(i, 2, "--") == 0) {
      size_t j = i + 2;
      while (j < out.size() && (absl::ascii_isalnum(out[j]) || out[j] == '_')) ++j;
      const std::string name = out.substr(i + 2, j - i - 2);
      text += "--";
      text += flags.contains(name) ? Hyphenated(name) : name;
      i = j;
      continue;
    }
    text += out[i++];
  }
  fputs(text.c_str(), stdout);
  fflush(stdout);
  std::exit(1);  // as Abseil's --help
}

}  // namespace

std::vector<char*> InitProgram(int argc, char** argv, absl::string_view process,
                               absl::string_view usage) {
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [](absl::string_view) { return true; };
  config.contains_help_flags = [](absl::string_view file) {
    // Only Tandem's own flags, not absl's internals.
    return file.find("absl/") == absl::string_view::npos;
  };
  config.version_string = []() { return std::string("tandem 0.1.0\n"); };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  // --max-tokens is --max_tokens: users type hyphens (issue 16, item 5), and
  // --help shows that spelling.
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) == "--") break;
    if (IsHelpFlag(argv[i])) PrintHelpAndExit(usage);
  }
  NormalizeFlagNames(argc, argv);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);

  log::Options options;
  std::string name = absl::GetFlag(FLAGS_log_process);
  options.process = name.empty() ? std::string(process) : name;
  if (!log::ParseFormat(absl::GetFlag(FLAGS_log_format), &options.format)) {
    fprintf(stderr, "error: --log_format must be text or json, got '%s'\n",
            absl::GetFlag(FLAGS_log_format).c_str());
    std::exit(2);
  }
  if (!log::ParseLevel(absl::GetFlag(FLAGS_log_level), &options.min_level)) {
    fprintf(stderr,
            "error: --log_level must be debug, info, warning or error, got '%s'\n",
            absl::GetFlag(FLAGS_log_level).c_str());
    std::exit(2);
  }
  log::Init(options);
  // Debian builds Abseil with mutex deadlock detection on: a graph update on
  // every lock, ~5% of the gateway's CPU per streamed token (docs/benchmarks.md,
  // gateway). Lock-order problems are for the sanitizers (--config=asan).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return args;
}

}  // namespace tandem
