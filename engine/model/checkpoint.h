// A K3 model directory opened for serving: config.json + safetensors weights
// (sharded with model.safetensors.index.json, or a single model.safetensors),
// memory-mapped, with typed tensor views by name.
//
//   Open(dir) → LoadModelConfig(dir/config.json) → SafetensorsSet::OpenDirectory
//   Get(name) → accepts "language_model.model.norm.weight" or "model.norm.weight";
//               the view carries the real (stored) name.
//   ValidateAgainstConfig() → compares every stored text tensor with
//               ExpectedTensors(config): missing, wrong dtype/shape, unknown extras.
#ifndef TANDEM_ENGINE_MODEL_CHECKPOINT_H_
#define TANDEM_ENGINE_MODEL_CHECKPOINT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_table.h"

namespace tandem::model {

class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir,
                                                          MapOptions options = {});

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const SafetensorsSet& tensors() const { return *tensors_; }

  // Looks `name` up as given, then with kTextPrefix added or removed.
  absl::StatusOr<TensorView> Get(absl::string_view name) const;
  // Get() plus a dtype and shape check; errors name the tensor and both shapes.
  absl::StatusOr<TensorView> GetChecked(absl::string_view name, DType dtype,
                                        const std::vector<int64_t>& shape) const;

  // OK when the stored text tensors are exactly ExpectedTensors(config()) with
  // matching dtypes and shapes. Otherwise one error listing every problem (up to
  // 50, then a count): missing tensors, dtype and shape mismatches (expected vs
  // actual), unknown text tensors. Vision tensors are ignored.
  absl::Status ValidateAgainstConfig() const;

 private:
  Checkpoint() = default;
  std::string dir_;
  ModelConfig config_;
  std::unique_ptr<SafetensorsSet> tensors_;
};

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_CHECKPOINT_H_
