// An independent JSON Schema validator for tests (the subset README.md lists,
// written from the draft 2020-12 text, sharing no code with the compiler):
// the random-walk tests check that every constrained output validates.
#ifndef TANDEM_ENGINE_GRAMMAR_TESTING_VALIDATOR_H_
#define TANDEM_ENGINE_GRAMMAR_TESTING_VALIDATOR_H_

#include <string>

#include "nlohmann/json.hpp"

namespace tandem::grammar::testing {

// Empty when `instance` is valid against `schema`, else the first violation.
std::string Validate(const nlohmann::json& schema, const nlohmann::json& instance);

}  // namespace tandem::grammar::testing

#endif  // TANDEM_ENGINE_GRAMMAR_TESTING_VALIDATOR_H_
