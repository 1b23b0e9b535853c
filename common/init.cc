#include "common/init.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/synchronization/mutex.h"
#include "common/flag_names.h"
#include "common/logging.h"

ABSL_FLAG(std::string, log_format, "text", "Log line format: text or json.");
ABSL_FLAG(std::string, log_level, "info",
          "Lowest level logged: debug, info, warning or error.");
ABSL_FLAG(std::string, log_process, "",
          "Process name shown on each log line (default: the program's own).");

namespace tandem {

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
  // --max-tokens is --max_tokens: users type hyphens (issue 16, item 5).
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
