// The byte tokenizer, GPT-2's vocab.json + merges.txt, tokenizer_config.json, and
// load_tokenizer's dispatch on what a path is.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/bpe.hpp"
#include "data/tokenizers.hpp"

namespace strata {
namespace {

using Json = nlohmann::json;

class ByteTokenizer final : public Tokenizer {
 public:
  std::int32_t vocab_size() const override { return 256; }
  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<std::int32_t> out(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
    return out;
  }
  Result<std::string> decode(const std::vector<std::int32_t>& ids) const override {
    std::string out(ids.size(), '\0');
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] > 255)
        return invalid_argument("byte tokenizer: id " + std::to_string(ids[i]) + " is not a byte");
      out[i] = static_cast<char>(ids[i]);
    }
    return out;
  }
  std::string name() const override { return "bytes"; }
  bool round_trips() const override { return true; }
};

Result<Json> read_json(const std::string& path, std::string_view what) {
  std::ifstream in(path);
  if (!in) return not_found(std::string(what) + " '" + path + "' cannot be opened");
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    return invalid_argument(std::string(what) + " '" + path + "' is not valid JSON: " + e.what());
  }
}

// vocab.json: {"token": id, ...}.
Status read_gpt2_vocab(const std::string& path, data::BpeSpec& spec) {
  STRATA_ASSIGN_OR_RETURN(Json vocab, read_json(path, "tokenizer vocab"));
  if (!vocab.is_object())
    return invalid_argument("tokenizer vocab '" + path + "': expected a JSON object of token -> id");
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<std::int64_t>() < 0 ||
        it.value().get<std::int64_t>() > (1 << 24)) {
      return invalid_argument("tokenizer vocab '" + path + "': token '" + it.key() + "' has id " +
                              it.value().dump() + ", expected a non-negative integer below 2^24");
    }
    spec.vocab.emplace_back(it.key(), static_cast<std::int32_t>(it.value().get<std::int64_t>()));
  }
  return ok_status();
}

// merges.txt: an optional "#version" line, then "left right" per line, best first.
Status read_gpt2_merges(const std::string& path, data::BpeSpec& spec) {
  std::ifstream mf(path);
  if (!mf) return not_found("tokenizer merges '" + path + "' cannot be opened");
  std::string line;
  int line_no = 0;
  while (std::getline(mf, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const auto sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() ||
        line.find(' ', sp + 1) != std::string::npos) {
      return invalid_argument("tokenizer merges '" + path + "' line " + std::to_string(line_no) +
                              ": expected two symbols separated by one space, found '" + line + "'");
    }
    spec.merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  return ok_status();
}

// A bos_token/eos_token value: a string, an AddedToken object {"content": ...}, or null ("").
Result<std::optional<std::string>> special_token_value(const Json& cfg, const char* key,
                                                       const std::string& path) {
  if (!cfg.contains(key)) return std::optional<std::string>();
  const Json& v = cfg[key];
  if (v.is_null()) return std::optional<std::string>(std::string());
  if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return std::optional<std::string>(v["content"].get<std::string>());
  return invalid_argument("tokenizer config '" + path + "': " + key + " is " + v.dump() +
                          ", expected a string, null or an object with a \"content\" string");
}

Result<std::optional<bool>> bool_value(const Json& cfg, const char* key, const std::string& path) {
  if (!cfg.contains(key) || cfg[key].is_null()) return std::optional<bool>();
  if (!cfg[key].is_boolean())
    return invalid_argument("tokenizer config '" + path + "': " + key + " is " + cfg[key].dump() +
                            ", expected true or false");
  return std::optional<bool>(cfg[key].get<bool>());
}

// What a file holds, by its first bytes: JSON (tokenizer.json or vocab.json) or not.
bool looks_like_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char c = 0;
  while (in.get(c)) {
    if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return c == '{';
  }
  return false;
}

}  // namespace

namespace data {

Result<SpecialTokensConfig> read_tokenizer_config(const std::string& tokenizer_path) {
  SpecialTokensConfig out;
  const std::filesystem::path p =
      std::filesystem::path(tokenizer_path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(p, ec)) return out;
  out.path = p.string();
  STRATA_ASSIGN_OR_RETURN(Json cfg, read_json(out.path, "tokenizer config"));
  if (!cfg.is_object())
    return invalid_argument("tokenizer config '" + out.path + "': expected a JSON object");
  STRATA_ASSIGN_OR_RETURN(out.bos_token, special_token_value(cfg, "bos_token", out.path));
  STRATA_ASSIGN_OR_RETURN(out.eos_token, special_token_value(cfg, "eos_token", out.path));
  STRATA_ASSIGN_OR_RETURN(out.add_bos_token, bool_value(cfg, "add_bos_token", out.path));
  STRATA_ASSIGN_OR_RETURN(out.add_eos_token, bool_value(cfg, "add_eos_token", out.path));
  return out;
}

}  // namespace data

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& vocab_path,
                                                      const std::string& merges_path) {
  data::BpeSpec spec;
  spec.name = "gpt2-bpe";
  STRATA_RETURN_IF_ERROR(read_gpt2_vocab(vocab_path, spec));
  STRATA_RETURN_IF_ERROR(read_gpt2_merges(merges_path, spec));
  // GPT-2's end of text, when the vocabulary has it (the files name no special tokens).
  for (const auto& [token, id] : spec.vocab) {
    if (token == "<|endoftext|>") spec.eos = id;
  }
  return data::make_byte_level_bpe(std::move(spec), "tokenizer vocab '" + vocab_path + "'");
}

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  if (path == "bytes") return make_byte_tokenizer();
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
      if (fs::is_regular_file(dir / name, ec)) return load_tokenizer((dir / name).string());
    }
    if (fs::is_regular_file(dir / "vocab.json", ec)) return load_tokenizer((dir / "vocab.json").string());
    return not_found("tokenizer directory '" + path +
                     "' holds no tokenizer.json, tokenizer.model or vocab.json + merges.txt");
  }
  if (!fs::is_regular_file(path, ec)) return not_found("tokenizer '" + path + "' does not exist");
  if (path.ends_with(".model") || !looks_like_json(path)) return data::load_sentencepiece(path);
  STRATA_ASSIGN_OR_RETURN(Json j, read_json(path, "tokenizer"));
  if (j.is_object() && j.contains("model")) return data::load_tokenizer_json(path);
  // A GPT-2 vocab.json: merges.txt beside it.
  const std::string merges = (fs::path(path).parent_path() / "merges.txt").string();
  if (!fs::is_regular_file(merges, ec)) {
    return not_found("tokenizer '" + path +
                     "' is a JSON object without a \"model\" (not a tokenizer.json); as a GPT-2 "
                     "vocab.json it needs merges.txt beside it, and '" +
                     merges + "' does not exist");
  }
  return load_bpe_tokenizer(path, merges);
}

}  // namespace strata
