// Process start-up shared by every binary: absl flags (with --help; hyphenated
// names accepted), logging configured from --log_format / --log_level, and the
// process name in each line.
#ifndef TANDEM_COMMON_INIT_H_
#define TANDEM_COMMON_INIT_H_

#include <vector>

#include "absl/strings/string_view.h"

namespace tandem {

// Parses flags (exits with a message on a bad flag; `--help` prints `usage`
// and every flag; a flag's name may be hyphenated, `--max-tokens 8` being
// `--max_tokens 8`: common/flag_names.h) and initialises logging as `process`. Returns
// the positional arguments, argv[0] first.
std::vector<char*> InitProgram(int argc, char** argv, absl::string_view process,
                               absl::string_view usage);

}  // namespace tandem

#endif  // TANDEM_COMMON_INIT_H_
