// What the router tells clients about the served model, read from the checkpoint's
// config.json (the router owns no weights).
#ifndef TANDEM_MODEL_SERVED_MODEL_H_
#define TANDEM_MODEL_SERVED_MODEL_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/router.pb.h"

namespace tandem::model {

struct ServedModel {
  tandem::v1::ModelInfo info;
  // XXH3-64 of config.json, hex: workers must report the same fingerprint.
  std::string fingerprint;
};

// Reads `model_dir`/config.json (K3 layout: text_config.vocab_size,
// text_config.max_position_embeddings, eos ids). `served_name` empty: "kimi-k3" for
// the K3 layout (model_type kimi_k3), else the directory's base name.
absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir,
                                            const std::string& served_name,
                                            int64_t created_unix);

}  // namespace tandem::model

#endif  // TANDEM_MODEL_SERVED_MODEL_H_
