#include "engine/model/served_model.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace tandem::model {
namespace {

absl::StatusOr<int64_t> GetInt(const nlohmann::json& obj, const char* key,
                               const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer()) {
    return InvalidArgument(where, ": '", key, "' must be an integer");
  }
  return it->get<int64_t>();
}

}  // namespace

absl::StatusOr<ServedModel> LoadServedModel(const std::string& model_dir,
                                            const std::string& served_name,
                                            int64_t created_unix) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open ", path);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  nlohmann::json config =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return InvalidArgument(path, ": not a JSON object");
  }
  const nlohmann::json* tc = &config;
  if (auto it = config.find("text_config"); it != config.end() && it->is_object()) {
    tc = &*it;
  }
  ServedModel out;
  TANDEM_ASSIGN_OR_RETURN(int64_t vocab, GetInt(*tc, "vocab_size", path));
  TANDEM_ASSIGN_OR_RETURN(int64_t ctx, GetInt(*tc, "max_position_embeddings", path));
  if (vocab <= 0 || ctx <= 0) {
    return InvalidArgument(path,
                           ": vocab_size and max_position_embeddings must be > 0");
  }
  std::set<int> eos;
  for (const nlohmann::json* obj :
       std::initializer_list<const nlohmann::json*>{&config, tc}) {
    auto it = obj->find("eos_token_id");
    if (it == obj->end()) continue;
    if (it->is_number_integer()) eos.insert(it->get<int>());
    if (it->is_array()) {
      for (const auto& v : *it) {
        if (v.is_number_integer()) eos.insert(v.get<int>());
      }
    }
  }
  std::string name = served_name;
  if (name.empty()) {
    auto mt = config.find("model_type");
    if (mt != config.end() && mt->is_string() && mt->get<std::string>() == "kimi_k3") {
      name = "kimi-k3";
    } else {
      std::string dir = model_dir;
      while (!dir.empty() && dir.back() == '/') dir.pop_back();
      name = dir.substr(dir.rfind('/') + 1);
    }
  }
  out.info.set_id(name);
  out.info.set_vocab_size(static_cast<int32_t>(vocab));
  out.info.set_max_context_tokens(ctx);
  for (int id : eos) out.info.add_eos_token_ids(id);
  out.info.set_created_unix(created_unix);
  out.fingerprint = absl::StrFormat("%016x", XXH3_64bits(text.data(), text.size()));
  return out;
}

}  // namespace tandem::model
