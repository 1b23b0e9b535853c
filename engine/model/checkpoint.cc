#include "engine/model/checkpoint.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tandem::model {
namespace {

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

constexpr size_t kMaxListedProblems = 50;

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir,
                                                             MapOptions options) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = dir;
  const std::string config_path =
      (dir.empty() || dir.back() == '/') ? dir + "config.json" : dir + "/config.json";
  TANDEM_ASSIGN_OR_RETURN(ckpt->config_, LoadModelConfig(config_path));
  TANDEM_ASSIGN_OR_RETURN(ckpt->tensors_, SafetensorsSet::OpenDirectory(dir, options));
  return ckpt;
}

absl::StatusOr<TensorView> Checkpoint::Get(absl::string_view name) const {
  if (tensors_->Contains(name)) return tensors_->Get(name);
  const absl::string_view bare = StripTextPrefix(name);
  if (bare.size() != name.size()) {
    if (tensors_->Contains(bare)) return tensors_->Get(bare);
  } else {
    const std::string prefixed = absl::StrCat(kTextPrefix, name);
    if (tensors_->Contains(prefixed)) return tensors_->Get(prefixed);
  }
  return NotFound(dir_, ": tensor '", name,
                  "' is not in the checkpoint (with or without '", kTextPrefix, "')");
}

absl::StatusOr<TensorView> Checkpoint::GetChecked(
    absl::string_view name, DType dtype, const std::vector<int64_t>& shape) const {
  TANDEM_ASSIGN_OR_RETURN(TensorView view, Get(name));
  if (view.dtype != dtype || view.shape != shape) {
    return InvalidArgument(dir_, ": tensor '", view.name, "': expected ",
                           DTypeName(dtype), ShapeStr(shape), ", got ",
                           DTypeName(view.dtype), ShapeStr(view.shape));
  }
  return view;
}

absl::Status Checkpoint::ValidateAgainstConfig() const {
  // Stored text tensors by their unprefixed name.
  std::map<std::string, std::string, std::less<>> stored;  // bare → real
  std::vector<std::string> problems;
  for (const std::string& real : tensors_->Names()) {
    if (IsVisionTensor(StripTextPrefix(real))) continue;
    auto [it, inserted] = stored.emplace(std::string(StripTextPrefix(real)), real);
    if (!inserted) {
      problems.push_back(absl::StrCat(
          "tensor '", real, "' is stored both with and without '", kTextPrefix, "'"));
    }
  }
  std::map<std::string, bool, std::less<>> expected_names;
  for (const ExpectedTensor& e : ExpectedTensors(config_)) {
    const absl::string_view bare = StripTextPrefix(e.name);
    expected_names.emplace(std::string(bare), true);
    auto it = stored.find(bare);
    if (it == stored.end()) {
      problems.push_back(absl::StrCat("missing tensor '", e.name, "' (",
                                      DTypeName(e.dtype), ShapeStr(e.shape), ")"));
      continue;
    }
    absl::StatusOr<TensorView> view = tensors_->Get(it->second);
    if (!view.ok()) {
      problems.push_back(std::string(view.status().message()));
      continue;
    }
    if (view->dtype != e.dtype) {
      problems.push_back(absl::StrCat("tensor '", view->name, "': expected dtype ",
                                      DTypeName(e.dtype), ", got ",
                                      DTypeName(view->dtype)));
    }
    if (view->shape != e.shape) {
      problems.push_back(absl::StrCat("tensor '", view->name, "': expected shape ",
                                      ShapeStr(e.shape), ", got ",
                                      ShapeStr(view->shape)));
    }
  }
  for (const auto& [bare, real] : stored) {
    if (expected_names.find(bare) == expected_names.end()) {
      problems.push_back(absl::StrCat("unknown tensor '", real,
                                      "' (not in the K3 table for "
                                      "this config)"));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  const size_t total = problems.size();
  if (total > kMaxListedProblems) {
    problems.resize(kMaxListedProblems);
    problems.push_back(absl::StrCat("... and ", total - kMaxListedProblems, " more"));
  }
  return FailedPrecondition(dir_, ": checkpoint does not match its config (", total,
                            " problem(s)): ", absl::StrJoin(problems, "; "));
}

}  // namespace tandem::model
