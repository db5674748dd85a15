// Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, LLaMA 3, Qwen2, ...), read into
// a BpeSpec (bpe.hpp). What is built, key by key; anything else is refused naming the key:
//   normalizer      null, NFC, or a Sequence of those
//   pre_tokenizer   ByteLevel (add_prefix_space, use_regex), Split (pattern Regex or String;
//                   behavior Isolated, Removed, MergedWithPrevious, MergedWithNext; invert), or a
//                   Sequence of those with exactly one ByteLevel, last
//   model           BPE: vocab, merges ("a b" strings or ["a", "b"] pairs), ignore_merges; no
//                   dropout, no continuing_subword_prefix / end_of_word_suffix, no byte_fallback
//   post_processor  null, ByteLevel, TemplateProcessing (its single template's special tokens
//                   before and after $A are the bos and eos it adds), or a Sequence of those
//   decoder         null or ByteLevel
//   added_tokens    content, id, lstrip, rstrip (single_word is refused)
// bos/eos: tokenizer_config.json's bos_token / eos_token and add_bos_token / add_eos_token win
// over the post-processor; without either, eos is the added token "<|endoftext|>",
// "<|end_of_text|>" or "</s>", the first the file has.
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/bpe.hpp"
#include "data/tokenizers.hpp"

namespace strata::data {
namespace {

using Json = nlohmann::json;

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  Status refuse(const std::string& key, const Json& value, const std::string& why) const {
    return invalid_argument("tokenizer '" + path_ + "': " + key + " = " + shorten(value.dump()) + " " + why);
  }
  Status bad(const std::string& key, const std::string& why) const {
    return invalid_argument("tokenizer '" + path_ + "': " + key + " " + why);
  }
  const std::string& path() const { return path_; }

  // obj[key] as a bool, `fallback` when absent or null; another type is an error naming key.
  Result<bool> flag(const Json& obj, const char* key, bool fallback, const std::string& at) const {
    if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return fallback;
    if (!obj[key].is_boolean()) return refuse(at + "." + key, obj[key], "is not true or false");
    return obj[key].get<bool>();
  }

  Status normalizer(const Json& n, const std::string& key, BpeSpec& spec) const {
    if (n.is_null()) return ok_status();
    const std::string type = type_of(n);
    if (type == "NFC") {
      spec.nfc = true;
      return ok_status();
    }
    if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
      for (std::size_t i = 0; i < n["normalizers"].size(); ++i)
        STRATA_RETURN_IF_ERROR(
            normalizer(n["normalizers"][i], key + ".normalizers[" + std::to_string(i) + "]", spec));
      return ok_status();
    }
    return refuse(key + ".type", type, "is not built (NFC or a Sequence of NFC only)");
  }

  Status pre_tokenizer(const Json& p, const std::string& key, BpeSpec& spec, bool& byte_level) const {
    if (p.is_null()) return bad(key, "is null: a byte-level BPE needs the ByteLevel pre-tokenizer");
    const std::string type = type_of(p);
    if (byte_level) return bad(key, "comes after the ByteLevel pre-tokenizer, which must be the last step");
    if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
      for (std::size_t i = 0; i < p["pretokenizers"].size(); ++i) {
        STRATA_RETURN_IF_ERROR(pre_tokenizer(
            p["pretokenizers"][i], key + ".pretokenizers[" + std::to_string(i) + "]", spec, byte_level));
      }
      return ok_status();
    }
    if (type == "ByteLevel") {
      byte_level = true;
      STRATA_ASSIGN_OR_RETURN(spec.add_prefix_space, flag(p, "add_prefix_space", false, key));
      STRATA_ASSIGN_OR_RETURN(spec.byte_level_regex, flag(p, "use_regex", true, key));
      return ok_status();
    }
    if (type == "Split") return split(p, key, spec);
    return refuse(key + ".type", type, "is not built (ByteLevel, Split, Sequence)");
  }

  Status split(const Json& p, const std::string& key, BpeSpec& spec) const {
    const Json pattern = p.contains("pattern") ? p["pattern"] : Json();
    std::string text;
    bool literal = false;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      text = pattern["Regex"].get<std::string>();
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      text = pattern["String"].get<std::string>();
      literal = true;
    } else {
      return refuse(key + ".pattern", pattern, "is not {\"Regex\": ...} or {\"String\": ...}");
    }
    auto re = Regex::compile(text, literal);
    if (!re.ok()) return bad(key + ".pattern", re.status().message());
    SplitStep step{.regex = std::move(*re), .behavior = SplitBehavior::kIsolated, .invert = false};
    STRATA_ASSIGN_OR_RETURN(step.invert, flag(p, "invert", false, key));
    if (p.contains("behavior") && !p["behavior"].is_string())
      return refuse(key + ".behavior", p["behavior"], "is not a string");
    const std::string behavior = p.contains("behavior") ? p["behavior"].get<std::string>() : "Isolated";
    if (behavior == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (behavior == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else if (behavior == "MergedWithPrevious") {
      step.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      step.behavior = SplitBehavior::kMergedWithNext;
    } else {
      return refuse(key + ".behavior", behavior,
                    "is not built (Isolated, Removed, MergedWithPrevious, MergedWithNext)");
    }
    spec.splits.push_back(std::move(step));
    return ok_status();
  }

  Status model(const Json& m, BpeSpec& spec) const {
    if (!m.is_object()) return bad("model", "is not an object");
    const std::string type = m.contains("type") ? type_of(m) : std::string("BPE");
    if (type != "BPE") {
      return refuse(
          "model.type", type,
          "is not built: only byte-level BPE tokenizer.json files are read (a SentencePiece model loads from "
          "its tokenizer.model)");
    }
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"] != 0 && m["dropout"] != 0.0)
      return refuse("model.dropout", m["dropout"], "is not built (BPE dropout is for training a tokenizer)");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(k) && !m[k].is_null() && m[k] != "")
        return refuse(std::string("model.") + k, m[k], "is not built (byte-level BPE has none)");
    }
    STRATA_ASSIGN_OR_RETURN(const bool byte_fallback, flag(m, "byte_fallback", false, "model"));
    if (byte_fallback)
      return refuse("model.byte_fallback", m["byte_fallback"],
                    "is not built (a byte-level BPE covers every byte)");
    STRATA_ASSIGN_OR_RETURN(spec.ignore_merges, flag(m, "ignore_merges", false, "model"));
    if (!m.contains("vocab") || !m["vocab"].is_object())
      return bad("model.vocab", "is missing or not an object");
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<std::int64_t>() < 0 ||
          it.value().get<std::int64_t>() >= (1ll << 31)) {
        return refuse("model.vocab['" + it.key() + "']", it.value(), "is not a non-negative 32-bit id");
      }
      spec.vocab.emplace_back(it.key(), static_cast<std::int32_t>(it.value().get<std::int64_t>()));
    }
    if (!m.contains("merges") || !m["merges"].is_array())
      return bad("model.merges", "is missing or not an array");
    const Json& merges = m["merges"];
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const Json& e = merges[i];
      const std::string k = "model.merges[" + std::to_string(i) + "]";
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size() ||
            s.find(' ', sp + 1) != std::string::npos)
          return refuse(k, e, "is not two symbols separated by one space");
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        spec.merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      } else {
        return refuse(k, e, "is not \"a b\" or [\"a\", \"b\"]");
      }
    }
    return ok_status();
  }

  Status added_tokens(const Json& list, BpeSpec& spec) const {
    if (list.is_null()) return ok_status();
    if (!list.is_array()) return bad("added_tokens", "is not an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Json& t = list[i];
      const std::string k = "added_tokens[" + std::to_string(i) + "]";
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          t["id"].get<std::int64_t>() < 0 || t["id"].get<std::int64_t>() >= (1ll << 31) ||
          !t.contains("content") || !t["content"].is_string()) {
        return refuse(k, t, "needs a non-negative integer \"id\" and a string \"content\"");
      }
      STRATA_ASSIGN_OR_RETURN(const bool single_word, flag(t, "single_word", false, k));
      STRATA_ASSIGN_OR_RETURN(const bool lstrip, flag(t, "lstrip", false, k));
      STRATA_ASSIGN_OR_RETURN(const bool rstrip, flag(t, "rstrip", false, k));
      if (single_word)
        return refuse(k + ".single_word", t["single_word"], "is not built (only whole-text matching)");
      spec.added.push_back(AddedToken{.content = t["content"].get<std::string>(),
                                      .id = static_cast<std::int32_t>(t["id"].get<std::int64_t>()),
                                      .lstrip = lstrip,
                                      .rstrip = rstrip});
    }
    return ok_status();
  }

  // bos/eos from a TemplateProcessing's single template.
  Status post_processor(const Json& p, const std::string& key, BpeSpec& spec) const {
    if (p.is_null()) return ok_status();
    const std::string type = type_of(p);
    if (type == "ByteLevel") return ok_status();  // offsets only
    if (type == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
      for (std::size_t i = 0; i < p["processors"].size(); ++i)
        STRATA_RETURN_IF_ERROR(
            post_processor(p["processors"][i], key + ".processors[" + std::to_string(i) + "]", spec));
      return ok_status();
    }
    if (type != "TemplateProcessing")
      return refuse(key + ".type", type, "is not built (ByteLevel, TemplateProcessing, Sequence)");
    const Json single = p.value("single", Json());
    if (!single.is_array()) return bad(key + ".single", "is missing or not an array");
    bool after = false;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const Json& item = single[i];
      const std::string k = key + ".single[" + std::to_string(i) + "]";
      if (item.contains("Sequence")) {
        if (after) return refuse(k, item, "is a second sequence; one ($A) is expected");
        after = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
        return refuse(k, item, "is neither a Sequence nor a SpecialToken");
      const Json name = item["SpecialToken"]["id"];
      const Json ids = p.value("special_tokens", Json::object())
                           .value(name.is_string() ? name.get<std::string>() : "", Json::object())
                           .value("ids", Json());
      if (!ids.is_array() || ids.size() != 1 || !ids[0].is_number_integer())
        return refuse(key + ".special_tokens[" + name.dump() + "].ids", ids, "is not one id");
      const auto id = static_cast<std::int32_t>(ids[0].get<std::int64_t>());
      std::int32_t& slot = after ? spec.eos : spec.bos;
      if (slot >= 0 && slot != id)
        return refuse(k, item, "adds a second " + std::string(after ? "eos" : "bos") + " token");
      slot = id;
      (after ? spec.adds_eos : spec.adds_bos) = true;
    }
    return ok_status();
  }

  Status decoder(const Json& d) const {
    if (d.is_null()) return ok_status();
    const std::string type = type_of(d);
    if (type != "ByteLevel") return refuse("decoder.type", type, "is not built (ByteLevel)");
    return ok_status();
  }

 private:
  static std::string type_of(const Json& j) {
    return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                        : j.dump();
  }
  static std::string shorten(std::string s) { return s.size() > 120 ? s.substr(0, 117) + "..." : s; }
  std::string path_;
};

// The id of `content` among the added tokens, then the vocabulary (byte-level text); -1 if none.
std::int32_t find_token(const BpeSpec& spec, const std::string& content) {
  for (const AddedToken& t : spec.added) {
    if (t.content == content) return t.id;
  }
  for (const auto& [token, id] : spec.vocab) {
    if (token == content) return id;
  }
  return -1;
}

Status apply_config(const SpecialTokensConfig& cfg, BpeSpec& spec) {
  auto resolve = [&](const std::optional<std::string>& name, const char* key, std::int32_t& slot) -> Status {
    if (!name) return ok_status();
    if (name->empty()) {
      slot = -1;
      return ok_status();
    }
    const std::int32_t id = find_token(spec, *name);
    if (id < 0) {
      return invalid_argument("tokenizer config '" + cfg.path + "': " + key + " '" + *name +
                              "' is not a token of the tokenizer");
    }
    slot = id;
    return ok_status();
  };
  STRATA_RETURN_IF_ERROR(resolve(cfg.bos_token, "bos_token", spec.bos));
  STRATA_RETURN_IF_ERROR(resolve(cfg.eos_token, "eos_token", spec.eos));
  if (cfg.add_bos_token) spec.adds_bos = *cfg.add_bos_token;
  if (cfg.add_eos_token) spec.adds_eos = *cfg.add_eos_token;
  if (spec.adds_bos && spec.bos < 0)
    return invalid_argument("tokenizer config '" + cfg.path +
                            "': add_bos_token is true but no bos_token is named");
  if (spec.adds_eos && spec.eos < 0)
    return invalid_argument("tokenizer config '" + cfg.path +
                            "': add_eos_token is true but no eos_token is named");
  return ok_status();
}

}  // namespace

namespace {

Result<std::unique_ptr<Tokenizer>> read_tokenizer_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("tokenizer '" + path + "' cannot be opened");
  Json j;
  try {
    j = Json::parse(in);
  } catch (const Json::exception& e) {
    return invalid_argument("tokenizer '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) return invalid_argument("tokenizer '" + path + "': expected a JSON object");
  const Reader r(path);
  BpeSpec spec;
  spec.name = "tokenizer.json:" + path;
  STRATA_RETURN_IF_ERROR(r.normalizer(j.value("normalizer", Json()), "normalizer", spec));
  bool byte_level = false;
  STRATA_RETURN_IF_ERROR(
      r.pre_tokenizer(j.value("pre_tokenizer", Json()), "pre_tokenizer", spec, byte_level));
  if (!byte_level)
    return r.bad("pre_tokenizer", "has no ByteLevel step: only byte-level BPE tokenizer.json files are read");
  STRATA_RETURN_IF_ERROR(r.model(j["model"], spec));
  STRATA_RETURN_IF_ERROR(r.added_tokens(j.value("added_tokens", Json()), spec));
  STRATA_RETURN_IF_ERROR(r.post_processor(j.value("post_processor", Json()), "post_processor", spec));
  STRATA_RETURN_IF_ERROR(r.decoder(j.value("decoder", Json())));
  if (spec.eos < 0) {
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
      bool added = false;
      for (const AddedToken& t : spec.added) added = added || t.content == name;
      if (added) {
        spec.eos = find_token(spec, name);
        break;
      }
    }
  }
  STRATA_ASSIGN_OR_RETURN(SpecialTokensConfig cfg, read_tokenizer_config(path));
  if (Status s = apply_config(cfg, spec); !s.ok()) return s.with_context("tokenizer '" + path + "'");
  return make_byte_level_bpe(std::move(spec), "tokenizer '" + path + "'");
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_tokenizer_json(const std::string& path) {
  try {
    return read_tokenizer_json(path);
  } catch (const nlohmann::json::exception& e) {
    // A value of a type the reader did not expect where it did not check (the checks above
    // name the key; this names the file).
    return invalid_argument("tokenizer '" + path + "': " + e.what());
  }
}

}  // namespace strata::data
