#include "engine/tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include "absl/memory/memory.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/tokenizer/pretokenizer.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open ", path);
  std::stringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return DataLoss("error reading ", path);
  return buf.str();
}

// Scratch for one encode call: a per-thread one for ordinary sizes; big texts
// get their own so that a thread does not keep a huge buffer.
class ScratchLease {
 public:
  explicit ScratchLease(size_t text_size) {
    constexpr size_t kKeepBytes = 1 << 20;
    if (text_size <= kKeepBytes) {
      thread_local PreTokenizerScratch shared;
      scratch_ = &shared;
    } else {
      owned_ = std::make_unique<PreTokenizerScratch>();
      scratch_ = owned_.get();
    }
  }
  PreTokenizerScratch* get() { return scratch_; }

 private:
  std::unique_ptr<PreTokenizerScratch> owned_;
  PreTokenizerScratch* scratch_;  // not owned when thread_local
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  return LoadFiles(dir + "/tiktoken.model", dir + "/tokenizer_config.json");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::LoadFiles(
    const std::string& model_path, const std::string& config_path) {
  TANDEM_ASSIGN_OR_RETURN(std::string model, ReadFile(model_path));
  TANDEM_ASSIGN_OR_RETURN(std::string config, ReadFile(config_path));
  TANDEM_ASSIGN_OR_RETURN(BytePairEncoder bpe,
                          BytePairEncoder::Parse(model, kNumBaseTokens, model_path));
  auto tok = absl::WrapUnique(new Tokenizer(std::move(bpe)));
  absl::Status st = tok->ParseConfig(config);
  if (!st.ok()) return Annotate(st, config_path);
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromContents(
    absl::string_view model_contents, absl::string_view config_json) {
  TANDEM_ASSIGN_OR_RETURN(
      BytePairEncoder bpe,
      BytePairEncoder::Parse(model_contents, kNumBaseTokens, "tiktoken.model"));
  auto tok = absl::WrapUnique(new Tokenizer(std::move(bpe)));
  absl::Status st = tok->ParseConfig(config_json);
  if (!st.ok()) return Annotate(st, "tokenizer_config.json");
  return tok;
}

absl::Status Tokenizer::ParseConfig(absl::string_view config_json) {
  special_names_.clear();
  special_flag_.assign(kNumReservedSpecialTokens, true);
  for (int i = 0; i < kNumReservedSpecialTokens; ++i) {
    // tokenization_kimi.py names an unnamed slot after its id.
    special_names_.push_back(
        absl::StrCat("<|reserved_token_", kNumBaseTokens + i, "|>"));
  }
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(config_json.begin(), config_json.end());
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("bad JSON: ", e.what());
  }
  if (!config.is_object() || !config.contains("added_tokens_decoder") ||
      !config["added_tokens_decoder"].is_object()) {
    return InvalidArgument("missing object 'added_tokens_decoder'");
  }
  for (const auto& [key, entry] : config["added_tokens_decoder"].items()) {
    int id;
    if (!absl::SimpleAtoi(key, &id)) {
      return InvalidArgument("added_tokens_decoder key '", key, "' is not an id");
    }
    if (id < kNumBaseTokens || id >= kVocabSize) {
      return InvalidArgument("added token id ", id, " outside the special slots [",
                             kNumBaseTokens, ", ", kVocabSize, ")");
    }
    if (!entry.is_object() || !entry.contains("content") ||
        !entry["content"].is_string() || entry["content"].get<std::string>().empty()) {
      return InvalidArgument("added token ", id, " lacks a string 'content'");
    }
    special_names_[id - kNumBaseTokens] = entry["content"].get<std::string>();
    if (entry.contains("special")) {
      if (!entry["special"].is_boolean()) {
        return InvalidArgument("added token ", id, ": 'special' is not a boolean");
      }
      special_flag_[id - kNumBaseTokens] = entry["special"].get<bool>();
    }
  }
  special_ids_.clear();
  for (int i = 0; i < kNumReservedSpecialTokens; ++i) {
    auto [it, inserted] = special_ids_.emplace(special_names_[i], kNumBaseTokens + i);
    if (!inserted) {
      return InvalidArgument("special spelling '", special_names_[i], "' used by ids ",
                             it->second, " and ", kNumBaseTokens + i);
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::EncodeTo(absl::string_view text, std::vector<int>* ids) const {
  ScratchLease scratch(text.size());
  return PreTokenize(text, scratch.get(),
                     [&](absl::string_view piece) { bpe_.Encode(piece, ids); });
}

absl::StatusOr<std::vector<int>> Tokenizer::Encode(absl::string_view text) const {
  std::vector<int> ids;
  ids.reserve(text.size() / 3 + 4);
  TANDEM_RETURN_IF_ERROR(EncodeTo(text, &ids));
  return ids;
}

absl::StatusOr<std::vector<int>> Tokenizer::EncodeWithSpecial(
    absl::string_view text, const absl::flat_hash_set<std::string>& allowed) const {
  std::vector<int> ids;
  if (allowed.empty()) {
    TANDEM_RETURN_IF_ERROR(EncodeTo(text, &ids));
    return ids;
  }
  for (const std::string& s : allowed) {
    if (!special_ids_.contains(s)) {
      return InvalidArgument("'", s, "' is not a special token");
    }
  }
  bool first_byte[256] = {};
  for (const std::string& s : allowed) first_byte[static_cast<uint8_t>(s[0])] = true;
  ScratchLease chunk_scratch(text.size());
  PreTokenizerScratch piece_scratch;
  absl::Status status;
  auto on_piece = [&](absl::string_view piece) { bpe_.Encode(piece, &ids); };
  TANDEM_RETURN_IF_ERROR(
      SplitChunks(text, chunk_scratch.get(), [&](absl::string_view chunk) {
        // tiktoken: the leftmost occurrence of any special spelling; one not
        // allowed is skipped (the search resumes one byte later).
        size_t start = 0;
        size_t search = 0;
        while (true) {
          size_t best = absl::string_view::npos;
          size_t best_len = 0;
          int best_id = -1;
          for (size_t k = search; k < chunk.size(); ++k) {
            if (!first_byte[static_cast<uint8_t>(chunk[k])]) continue;
            for (const std::string& s : allowed) {
              if (chunk.substr(k, s.size()) == s) {
                best = k;
                best_len = s.size();
                best_id = special_ids_.at(s);
                break;
              }
            }
            if (best != absl::string_view::npos) break;
          }
          const size_t seg_end = best == absl::string_view::npos ? chunk.size() : best;
          if (seg_end > start) {
            absl::Status st = PreTokenizeChunk(chunk.substr(start, seg_end - start),
                                               &piece_scratch, on_piece);
            if (!st.ok() && status.ok()) status = st;
          }
          if (best == absl::string_view::npos) break;
          ids.push_back(best_id);
          start = search = best + best_len;
        }
      }));
  TANDEM_RETURN_IF_ERROR(status);
  return ids;
}

absl::Status Tokenizer::AppendTokenBytes(int id, std::string* out) const {
  if (id >= 0 && id < kNumBaseTokens) {
    const absl::string_view b = bpe_.Bytes(id);
    out->append(b.data(), b.size());
    return absl::OkStatus();
  }
  if (id >= kNumBaseTokens && id < kVocabSize) {
    out->append(special_names_[id - kNumBaseTokens]);
    return absl::OkStatus();
  }
  return InvalidArgument("token id ", id, " outside [0, ", kVocabSize, ")");
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int> ids,
                                              bool skip_special_tokens) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (int id : ids) {
    if (skip_special_tokens && IsSpecial(id)) continue;
    TANDEM_RETURN_IF_ERROR(AppendTokenBytes(id, &out));
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::IdToken(int id) const {
  std::string out;
  TANDEM_RETURN_IF_ERROR(AppendTokenBytes(id, &out));
  return out;
}

absl::StatusOr<int> Tokenizer::TokenId(absl::string_view token) const {
  if (auto it = special_ids_.find(token); it != special_ids_.end()) return it->second;
  if (!token.empty()) {
    if (int r = bpe_.Rank(token); r >= 0) return r;
  }
  return NotFound("no token '", absl::CHexEscape(token), "'");
}

absl::flat_hash_set<std::string> Tokenizer::AllSpecialTokens() const {
  return absl::flat_hash_set<std::string>(special_names_.begin(), special_names_.end());
}

}  // namespace tandem::tokenizer
