// A deterministic corpus of JSON Schemas covering every supported feature of
// the grammar engine (README.md): basic types, string lengths, formats,
// patterns, integer/number bounds, enum/const, objects (required/optional,
// additionalProperties), arrays (items, prefixItems, min/maxItems),
// anyOf/oneOf/allOf, $ref/$defs with recursion, type arrays and nullable,
// realistic tool-parameter schemas and seeded random nestings.
//
// Shared by the engine's tests and benchmark and by the integration tests
// (testdata/schema_corpus.jsonl holds the same corpus, one schema a line).
#ifndef TANDEM_ENGINE_GRAMMAR_SCHEMA_CORPUS_H_
#define TANDEM_ENGINE_GRAMMAR_SCHEMA_CORPUS_H_

#include <string>
#include <vector>

namespace tandem::grammar {

struct CorpusSchema {
  std::string name;     // unique, "<feature>/<n>"
  std::string feature;  // the feature it exercises
  std::string schema;   // compact JSON text
};

// At least 200 schemas; the same list every call.
const std::vector<CorpusSchema>& SchemaCorpus();

// The corpus as JSON lines: {"name":..., "feature":..., "schema":{...}}.
std::string SchemaCorpusJsonl();

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_SCHEMA_CORPUS_H_
