// tokenize: JSON lines {"text": ...} on stdin → {"ids": [...]} on stdout.
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "engine/tokenizer/jsonl_tools.h"
#include "engine/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, model, "",
          "Directory with tiktoken.model and tokenizer_config.json.");

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "tokenize",
      "Encodes JSON lines {\"text\": ...} from stdin with the Kimi K3 tokenizer and "
      "writes {\"ids\": [...]} per line (a bad line gives {\"error\": ...}; exit "
      "status 1 if any line failed).\nUsage: tokenize --model DIR < in.jsonl");
  std::ios::sync_with_stdio(false);
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::fprintf(stderr, "tokenize: --model DIR is required\n");
    return 2;
  }
  auto tokenizer = tandem::tokenizer::Tokenizer::Load(absl::GetFlag(FLAGS_model));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "tokenize: %s\n", tokenizer.status().ToString().c_str());
    return 2;
  }
  const int failed =
      tandem::tokenizer::RunTokenizeJsonl(**tokenizer, std::cin, std::cout);
  return failed > 0 ? 1 : 0;
}
