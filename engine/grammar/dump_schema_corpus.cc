// Writes the schema corpus as JSON lines (engine/grammar/testdata/
// schema_corpus.jsonl when run with `bazel run`, else to stdout).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "engine/grammar/schema_corpus.h"

int main() {
  const std::string text = tandem::grammar::SchemaCorpusJsonl();
  const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  if (ws == nullptr) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  const std::string path =
      std::string(ws) + "/engine/grammar/testdata/schema_corpus.jsonl";
  std::ofstream out(path, std::ios::binary);
  out << text;
  std::printf("wrote %s\n", path.c_str());
  return out ? 0 : 1;
}
