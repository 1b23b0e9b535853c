// make_checkpoint: writes a deterministic K3-architecture checkpoint with random
// weights (see make_checkpoint.h and docs/model_format.md).
//
//   make_checkpoint --out DIR [--size tiny|mid] [--seed N] [--shards N]
//                   [--tokenizer_dir third_party/kimi_k3_tokenizer]
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/logging.h"
#include "engine/model/make_checkpoint.h"

ABSL_FLAG(std::string, out, "", "Output directory (created if absent).");
ABSL_FLAG(std::string, size, "tiny", "Model size: tiny or mid.");
ABSL_FLAG(uint64_t, seed, 0, "PRNG seed; the same seed gives byte-identical files.");
ABSL_FLAG(int, shards, 0, "Number of safetensors shards (0: 3 for tiny, 4 for mid).");
ABSL_FLAG(std::string, tokenizer_dir, "third_party/kimi_k3_tokenizer",
          "Directory with tiktoken.model, tokenizer_config.json, pat_str.json to copy "
          "(empty: copy none).");

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "make_checkpoint",
                      "make_checkpoint --out DIR [--size tiny|mid] [--seed N]");
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "error: --out is required\n");
    return 2;
  }
  absl::StatusOr<tandem::model::ModelConfig> config =
      tandem::model::ConfigForSize(absl::GetFlag(FLAGS_size));
  if (!config.ok()) {
    std::fprintf(stderr, "error: %s\n", config.status().ToString().c_str());
    return 2;
  }
  tandem::model::MakeCheckpointOptions options;
  options.out_dir = out;
  options.config = *config;
  options.seed = absl::GetFlag(FLAGS_seed);
  int shards = absl::GetFlag(FLAGS_shards);
  options.num_shards =
      shards > 0 ? shards : (absl::GetFlag(FLAGS_size) == "mid" ? 4 : 3);
  options.tokenizer_dir = absl::GetFlag(FLAGS_tokenizer_dir);
  absl::Status status = tandem::model::MakeCheckpoint(options);
  if (!status.ok()) {
    TLOG(ERROR, "make_checkpoint failed").Kv("error", status);
    return 1;
  }
  TLOG(INFO, "checkpoint written")
      .Kv("dir", out)
      .Kv("size", absl::GetFlag(FLAGS_size))
      .Kv("seed", static_cast<int64_t>(options.seed));
  return 0;
}
