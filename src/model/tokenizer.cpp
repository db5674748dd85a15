// Byte-level and GPT-2 BPE tokenizers.
#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "strata/data.hpp"

namespace strata {
namespace {

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
      if (ids[i] < 0 || ids[i] > 255) return invalid_argument("byte tokenizer: id " + std::to_string(ids[i]) + " is not a byte");
      out[i] = static_cast<char>(ids[i]);
    }
    return out;
  }
  std::string name() const override { return "bytes"; }
};

// GPT-2's reversible byte -> unicode code point map: printable bytes map to themselves, the
// rest to code points from 256 up, so every token is printable text in vocab.json.
std::vector<std::uint32_t> byte_to_codepoint() {
  std::vector<std::uint32_t> map(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = direct[b] ? static_cast<std::uint32_t>(b) : next++;
  return map;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Splits a UTF-8 string into code points (the vocabulary's alphabet is code points < 0x800).
bool decode_utf8(std::string_view s, std::vector<std::uint32_t>& out) {
  out.clear();
  for (std::size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out.push_back(c);
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
      out.push_back(((c & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu));
      i += 2;
    } else if ((c & 0xF0) == 0xE0 && i + 2 < s.size()) {
      out.push_back(((c & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
                    (static_cast<unsigned char>(s[i + 2]) & 0x3Fu));
      i += 3;
    } else {
      return false;
    }
  }
  return true;
}

bool is_letter(unsigned char c) { return std::isalpha(c) || c >= 0x80; }
bool is_digit(unsigned char c) { return std::isdigit(c); }
bool is_space(unsigned char c) { return std::isspace(c); }

// GPT-2 pre-tokenization: 's 't 're 've 'm 'll 'd | ?letters | ?digits | ?other | spaces.
std::vector<std::string_view> pretokenize(std::string_view text) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  const std::size_t n = text.size();
  auto at = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  while (i < n) {
    std::size_t start = i;
    if (text[i] == '\'') {
      bool matched = false;
      for (std::string_view c : {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}) {
        if (text.substr(i, c.size()) == c) {
          out.push_back(text.substr(i, c.size()));
          i += c.size();
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    std::size_t j = i;
    if (at(j) == ' ' && j + 1 < n && !is_space(at(j + 1))) ++j;  // optional leading space
    if (j < n && is_letter(at(j))) {
      while (j < n && is_letter(at(j))) ++j;
    } else if (j < n && is_digit(at(j))) {
      while (j < n && is_digit(at(j))) ++j;
    } else if (j < n && !is_space(at(j))) {
      while (j < n && !is_space(at(j)) && !is_letter(at(j)) && !is_digit(at(j))) ++j;
    } else {
      // A whitespace run; if followed by a non-space, leave its last space for the next token.
      j = i;
      while (j < n && is_space(at(j))) ++j;
      if (j < n && j - i > 1) --j;
    }
    out.push_back(text.substr(start, j - start));
    i = j;
  }
  return out;
}

class BpeTokenizer final : public Tokenizer {
 public:
  std::int32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return "gpt2-bpe"; }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<std::int32_t> out;
    for (std::string_view piece : pretokenize(text)) {
      // Symbols: one per byte, as the vocabulary's code-point strings.
      std::vector<std::string> symbols;
      for (unsigned char b : piece) {
        std::string s;
        append_utf8(s, byte_map_[b]);
        symbols.push_back(std::move(s));
      }
      // Repeatedly merge the best-ranked adjacent pair.
      while (symbols.size() > 1) {
        int best_rank = INT_MAX;
        std::size_t best = 0;
        for (std::size_t k = 0; k + 1 < symbols.size(); ++k) {
          auto it = ranks_.find(symbols[k] + '\x01' + symbols[k + 1]);
          if (it != ranks_.end() && it->second < best_rank) {
            best_rank = it->second;
            best = k;
          }
        }
        if (best_rank == INT_MAX) break;
        symbols[best] += symbols[best + 1];
        symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      }
      for (const auto& s : symbols) {
        auto it = vocab_.find(s);
        if (it != vocab_.end()) {
          out.push_back(it->second);
        } else {
          // A symbol the vocabulary lacks falls back to its single-byte tokens.
          std::vector<std::uint32_t> cps;
          decode_utf8(s, cps);
          for (auto cp : cps) {
            std::string one;
            append_utf8(one, cp);
            auto b = vocab_.find(one);
            if (b != vocab_.end()) out.push_back(b->second);
          }
        }
      }
    }
    return out;
  }

  Result<std::string> decode(const std::vector<std::int32_t>& ids) const override {
    std::string out;
    std::vector<std::uint32_t> cps;
    for (auto id : ids) {
      if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size() || id_to_token_[id].empty()) {
        return invalid_argument("bpe tokenizer: id " + std::to_string(id) + " is not in the vocabulary");
      }
      decode_utf8(id_to_token_[id], cps);
      for (auto cp : cps) {
        auto it = codepoint_to_byte_.find(cp);
        if (it == codepoint_to_byte_.end()) return data_loss("bpe tokenizer: token " + std::to_string(id) + " has a character outside the byte alphabet");
        out += static_cast<char>(it->second);
      }
    }
    return out;
  }

  static Result<std::unique_ptr<Tokenizer>> load(const std::string& vocab_path, const std::string& merges_path) {
    auto tok = std::make_unique<BpeTokenizer>();
    tok->byte_map_ = byte_to_codepoint();
    for (int b = 0; b < 256; ++b) tok->codepoint_to_byte_[tok->byte_map_[b]] = static_cast<std::uint8_t>(b);
    std::ifstream vf(vocab_path);
    if (!vf) return not_found("tokenizer vocab '" + vocab_path + "' cannot be opened");
    nlohmann::json vocab;
    try {
      vf >> vocab;
    } catch (const nlohmann::json::parse_error& e) {
      return invalid_argument("tokenizer vocab '" + vocab_path + "' is not valid JSON: " + e.what());
    }
    if (!vocab.is_object()) return invalid_argument("tokenizer vocab '" + vocab_path + "': expected a JSON object of token -> id");
    std::int32_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<std::int64_t>() < 0 || it.value().get<std::int64_t>() > (1 << 24)) {
        return invalid_argument("tokenizer vocab '" + vocab_path + "': token '" + it.key() + "' has id " + it.value().dump() +
                                ", expected a non-negative integer");
      }
      auto id = static_cast<std::int32_t>(it.value().get<std::int64_t>());
      tok->vocab_[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    tok->vocab_size_ = max_id + 1;
    tok->id_to_token_.assign(static_cast<std::size_t>(tok->vocab_size_), "");
    // Two tokens with one id would make decode() give back the other token's text.
    std::vector<bool> taken(static_cast<std::size_t>(tok->vocab_size_), false);
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const auto id = static_cast<std::size_t>(it.value().get<std::int64_t>());
      if (taken[id]) {
        return invalid_argument("tokenizer vocab '" + vocab_path + "': token '" + it.key() + "' has id " +
                                std::to_string(id) + ", which token '" + tok->id_to_token_[id] +
                                "' already has; ids must be distinct");
      }
      taken[id] = true;
      tok->id_to_token_[id] = it.key();
    }
    for (int b = 0; b < 256; ++b) {
      std::string s;
      append_utf8(s, tok->byte_map_[b]);
      if (!tok->vocab_.count(s)) {
        return invalid_argument("tokenizer vocab '" + vocab_path + "' lacks the single-byte token for byte " + std::to_string(b));
      }
    }
    std::ifstream mf(merges_path);
    if (!mf) return not_found("tokenizer merges '" + merges_path + "' cannot be opened");
    std::string line;
    int rank = 0;
    int line_no = 0;
    while (std::getline(mf, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
      auto sp = line.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() || line.find(' ', sp + 1) != std::string::npos) {
        return invalid_argument("tokenizer merges '" + merges_path + "' line " + std::to_string(line_no) +
                                ": expected two symbols separated by one space, found '" + line + "'");
      }
      tok->ranks_.emplace(line.substr(0, sp) + '\x01' + line.substr(sp + 1), rank++);
    }
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

 private:
  std::unordered_map<std::string, std::int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int> ranks_;
  std::vector<std::uint32_t> byte_map_;
  std::unordered_map<std::uint32_t, std::uint8_t> codepoint_to_byte_;
  std::int32_t vocab_size_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& vocab_path, const std::string& merges_path) {
  return BpeTokenizer::load(vocab_path, merges_path);
}

}  // namespace strata
