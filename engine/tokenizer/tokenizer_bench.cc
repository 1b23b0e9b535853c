// tokenizer_bench: encoding throughput of the C++ tokenizer and of the Node
// oracle (tools/node/tiktoken_oracle.mjs) on the same input, the test corpus
// repeated to --target_mb. Load times are excluded on both sides. Ends with
// one JSON line of key figures.
//
//   bazel run //engine/tokenizer:tokenizer_bench
//   bazel-bin/engine/tokenizer/tokenizer_bench   (from the workspace root)
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "third_party/kimi_k3_tokenizer",
          "Directory with tiktoken.model, tokenizer_config.json, pat_str.json.");
ABSL_FLAG(std::string, corpus, "tests/data/tokenizer/corpus.jsonl",
          "JSON lines {\"text\": ...} to encode.");
ABSL_FLAG(double, target_mb, 4.0, "Repeat the corpus until it holds this many MB.");
ABSL_FLAG(std::string, oracle, "tools/node/tiktoken_oracle.mjs", "The Node oracle.");
ABSL_FLAG(std::string, node, "node", "The node executable.");
ABSL_FLAG(bool, skip_node, false, "Measure the C++ tokenizer only.");

namespace {

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "tokenizer_bench",
                      "Tokenizer throughput, C++ vs the Node oracle.\n"
                      "Usage: tokenizer_bench [--target_mb 4] [--skip_node]");
  auto tok = tandem::tokenizer::Tokenizer::Load(absl::GetFlag(FLAGS_model));
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", tok.status().ToString().c_str());
    return 2;
  }
  std::ifstream in(absl::GetFlag(FLAGS_corpus));
  if (!in) {
    std::fprintf(stderr, "tokenizer_bench: cannot open %s\n",
                 absl::GetFlag(FLAGS_corpus).c_str());
    return 2;
  }
  std::vector<std::string> texts;
  size_t corpus_bytes = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    texts.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
    corpus_bytes += texts.back().size();
  }
  const int repeat = std::max<int>(
      1, static_cast<int>(absl::GetFlag(FLAGS_target_mb) * 1e6 / corpus_bytes + 0.5));

  // C++: one warm-up pass, then the timed passes.
  std::vector<int> ids;
  for (const std::string& t : texts) (void)(*tok)->EncodeTo(t, &ids);
  size_t cpp_tokens = 0;
  size_t bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeat; ++r) {
    for (const std::string& t : texts) {
      ids.clear();
      if (!(*tok)->EncodeTo(t, &ids).ok()) return 1;
      cpp_tokens += ids.size();
      bytes += t.size();
    }
  }
  const double cpp_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpp_mbps = bytes / 1e6 / cpp_s;
  std::printf("input: %zu texts x %d = %.2f MB\n", texts.size(), repeat, bytes / 1e6);
  std::printf("c++ : %.3f s, %.2f MB/s, %zu tokens\n", cpp_s, cpp_mbps, cpp_tokens);

  nlohmann::json figures = {{"bench", "tokenizer"},
                            {"input_mb", bytes / 1e6},
                            {"tokens", cpp_tokens},
                            {"cpp_mb_per_s", cpp_mbps}};
  if (!absl::GetFlag(FLAGS_skip_node)) {
    const std::string cmd = absl::StrCat(
        Quote(absl::GetFlag(FLAGS_node)), " ", Quote(absl::GetFlag(FLAGS_oracle)),
        " --model ", Quote(absl::GetFlag(FLAGS_model)), " --bench ",
        Quote(absl::GetFlag(FLAGS_corpus)), " --repeat ", repeat);
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    if (p != nullptr) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    }
    const int rc = p == nullptr ? -1 : pclose(p);
    nlohmann::json node;
    try {
      node = nlohmann::json::parse(out);
    } catch (const nlohmann::json::exception&) {
    }
    if (rc != 0 || !node.is_object() || !node.contains("seconds")) {
      std::fprintf(stderr, "tokenizer_bench: node oracle failed (rc=%d): %s\n", rc,
                   out.c_str());
      return 1;
    }
    const double node_s = node["seconds"].get<double>();
    const double node_mbps = node["bytes"].get<double>() / 1e6 / node_s;
    const bool same_tokens = node["tokens"].get<size_t>() == cpp_tokens;
    std::printf("node: %.3f s, %.2f MB/s, %zu tokens (%s)\n", node_s, node_mbps,
                node["tokens"].get<size_t>(),
                same_tokens ? "same count" : "COUNT DIFFERS");
    std::printf("ratio c++/node: %.2fx\n", cpp_mbps / node_mbps);
    figures["node_mb_per_s"] = node_mbps;
    figures["ratio"] = cpp_mbps / node_mbps;
    figures["token_counts_match"] = same_tokens;
  }
  std::printf("%s\n", figures.dump().c_str());
  return 0;
}
