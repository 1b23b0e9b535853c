// Hyphenated flag names, the usual command-line convention (`--max-tokens 8`),
// accepted by binaries whose flags are Abseil's (`--max_tokens`).
#ifndef TANDEM_COMMON_FLAG_NAMES_H_
#define TANDEM_COMMON_FLAG_NAMES_H_

#include <string>
#include <vector>

namespace tandem {

// `args` (argv[0] first) with every hyphenated name of a flag this binary
// defines spelled the Abseil way: `--max-tokens 8`, `--max-tokens=8` and
// `-max-tokens=8` become `--max_tokens ...`, and `--no-ignore-eos` (a boolean's
// negation) becomes `--noignore_eos`. Values are never rewritten: the argument
// after a non-boolean flag given without `=` is its value and is skipped, and
// everything after `--` is positional. A name that matches no flag either way
// is left as it is, for absl::ParseCommandLine to report.
std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& args);

// The same, rewriting argv's strings in place (a normalised name is never
// longer than the original). Call it before InitProgram / ParseCommandLine.
void NormalizeFlagNames(int argc, char** argv);

}  // namespace tandem

#endif  // TANDEM_COMMON_FLAG_NAMES_H_
