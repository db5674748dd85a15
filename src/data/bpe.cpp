// Byte-level BPE (bpe.hpp): the regexes through PCRE2, NFC through ICU, the merges by hand (no
// Debian library implements Hugging Face's BPE model).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/bpe.hpp"

#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <queue>
#include <unordered_map>

namespace strata::data {

// ---- text helpers ---------------------------------------------------------------------------------

std::vector<std::uint32_t> byte_to_codepoint() {
  std::vector<std::uint32_t> map(256, 0);
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    map[static_cast<std::size_t>(b)] = direct ? static_cast<std::uint32_t>(b) : next++;
  }
  return map;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto at = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const auto cont = [&](std::size_t k) { return k < s.size() && (at(k) & 0xC0) == 0x80; };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(i + 1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(i + 1) || !cont(i + 2)) return 0;
    const unsigned char c1 = at(i + 1);
    if (c == 0xE0 && c1 < 0xA0) return 0;   // overlong
    if (c == 0xED && c1 >= 0xA0) return 0;  // surrogates
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    const unsigned char c1 = at(i + 1);
    if (c == 0xF0 && c1 < 0x90) return 0;   // overlong
    if (c == 0xF4 && c1 >= 0x90) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

namespace {

// NFC of valid UTF-8.
std::string nfc_valid(std::string_view text) {
  UErrorCode err = U_ZERO_ERROR;
  const UNormalizer2* n = unorm2_getNFCInstance(&err);
  if (U_FAILURE(err)) return std::string(text);
  std::vector<UChar> u16(text.size() + 1);
  std::int32_t len16 = 0;
  u_strFromUTF8(u16.data(), static_cast<std::int32_t>(u16.size()), &len16, text.data(),
                static_cast<std::int32_t>(text.size()), &err);
  if (U_FAILURE(err)) return std::string(text);
  if (unorm2_quickCheck(n, u16.data(), len16, &err) == UNORM_YES && U_SUCCESS(err)) return std::string(text);
  err = U_ZERO_ERROR;
  // NFC never more than triples the length of UTF-16 text (Unicode's stated bound).
  std::vector<UChar> out(static_cast<std::size_t>(len16) * 3 + 1);
  const std::int32_t out_len =
      unorm2_normalize(n, u16.data(), len16, out.data(), static_cast<std::int32_t>(out.size()), &err);
  if (U_FAILURE(err)) return std::string(text);
  std::string utf8(static_cast<std::size_t>(out_len) * 3 + 1, '\0');
  std::int32_t len8 = 0;
  u_strToUTF8(utf8.data(), static_cast<std::int32_t>(utf8.size()), &len8, out.data(), out_len, &err);
  if (U_FAILURE(err)) return std::string(text);
  utf8.resize(static_cast<std::size_t>(len8));
  return utf8;
}

}  // namespace

std::string nfc(std::string_view text) {
  std::string out;
  std::size_t run = 0, i = 0;
  while (i < text.size()) {
    const std::size_t n = utf8_length(text, i);
    if (n != 0) {
      i += n;
      continue;
    }
    out += nfc_valid(text.substr(run, i - run));
    out += text[i];
    run = ++i;
  }
  out += nfc_valid(text.substr(run));
  return out;
}

// ---- Regex ------------------------------------------------------------------------------------------

Result<Regex> Regex::compile(const std::string& pattern, bool literal) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  const std::uint32_t options =
      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0u);
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &code,
                                 &offset, nullptr);
  if (re == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(code, message, sizeof message);
    return invalid_argument("regex '" + pattern + "' does not compile at offset " + std::to_string(offset) +
                            ": " + reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // interpreted matching when the JIT is unavailable
  Regex r;
  r.code_ = re;
  return r;
}

Regex::Regex(Regex&& o) noexcept : code_(o.code_) { o.code_ = nullptr; }
Regex& Regex::operator=(Regex&& o) noexcept {
  std::swap(code_, o.code_);
  return *this;
}
Regex::~Regex() {
  if (code_ != nullptr) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

std::vector<std::pair<std::size_t, std::size_t>> Regex::matches(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  auto* re = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t start = 0;
  while (start <= text.size()) {
    const int rc = pcre2_match(re, subject, text.size(), start, 0, md, nullptr);
    if (rc < 0) break;  // no match (or a matching limit: the rest stays one piece)
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const std::size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      start = e;
    } else {
      // An empty match: go on after the character there.
      if (b >= text.size()) break;
      const std::size_t n = utf8_length(text, b);
      start = b + (n == 0 ? 1 : n);
    }
  }
  pcre2_match_data_free(md);
  return out;
}

// ---- the tokenizer -----------------------------------------------------------------------------------

namespace {

// A merge of two adjacent symbols: its rank (lower first) and the symbol it makes.
struct Merge {
  std::int32_t rank;
  std::int32_t id;
};

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

class ByteLevelBpe final : public Tokenizer {
 public:
  explicit ByteLevelBpe(BpeSpec spec) : spec_(std::move(spec)) {}

  std::int32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return spec_.name; }
  std::int32_t bos_id() const override { return spec_.bos; }
  std::int32_t eos_id() const override { return spec_.eos; }
  bool adds_bos() const override { return spec_.adds_bos; }
  bool adds_eos() const override { return spec_.adds_eos; }
  bool round_trips() const override { return !spec_.nfc && !spec_.add_prefix_space && !removes_text_; }

  Status build(const std::string& where);

  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<std::int32_t> out;
    std::size_t pos = 0;
    while (pos < text.size()) {
      const AddedMatch m = find_added(text, pos);
      encode_segment(text.substr(pos, m.begin - pos), out);
      if (m.token == nullptr) break;
      out.push_back(m.token->id);
      pos = m.end;
    }
    return out;
  }

  Result<std::string> decode(const std::vector<std::int32_t>& ids) const override {
    std::string out;
    for (std::int32_t id : ids) {
      if (id < 0 || id >= vocab_size_ || !known_[static_cast<std::size_t>(id)]) {
        return invalid_argument(spec_.name + ": id " + std::to_string(id) + " is not in the vocabulary");
      }
      out += bytes_[static_cast<std::size_t>(id)];
    }
    return out;
  }

 private:
  struct AddedMatch {
    std::size_t begin, end;
    const AddedToken* token;  // nullptr: none (begin = end = text size)
  };

  // The leftmost, then longest, added token at or after `pos`, with the whitespace it strips.
  AddedMatch find_added(std::string_view text, std::size_t pos) const {
    if (!spec_.added.empty()) {
      for (std::size_t i = pos; i < text.size(); ++i) {
        const auto& candidates = added_by_byte_[static_cast<unsigned char>(text[i])];
        for (const AddedToken* t : candidates) {  // longest first
          if (text.compare(i, t->content.size(), t->content) != 0) continue;
          std::size_t b = i, e = i + t->content.size();
          if (t->lstrip)
            while (b > pos && is_space(text[b - 1])) --b;
          if (t->rstrip)
            while (e < text.size() && is_space(text[e])) ++e;
          return {b, e, t};
        }
      }
    }
    return {text.size(), text.size(), nullptr};
  }

  static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  }

  void encode_segment(std::string_view segment, std::vector<std::int32_t>& out) const {
    if (segment.empty()) return;
    const std::string normalized = spec_.nfc ? nfc(segment) : std::string(segment);
    std::vector<std::string_view> pieces{normalized};
    for (const SplitStep& step : spec_.splits) pieces = split(pieces, step.regex, step.behavior, step.invert);
    std::string prefixed;
    for (std::string_view piece : pieces) {
      if (spec_.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
        prefixed = " " + std::string(piece);
        piece = prefixed;
      }
      if (!spec_.byte_level_regex) {
        encode_piece(piece, out);
        continue;
      }
      for (std::string_view p : split({piece}, *gpt2_, SplitBehavior::kIsolated, false)) encode_piece(p, out);
    }
  }

  // Each input piece cut by `regex`; pieces are views of the inputs.
  static std::vector<std::string_view> split(const std::vector<std::string_view>& in, const Regex& regex,
                                             SplitBehavior behavior, bool invert) {
    std::vector<std::string_view> out;
    for (std::string_view text : in) {
      // Alternating gaps and matches; with invert the matches play the gaps' part.
      std::vector<std::pair<std::string_view, bool>> parts;  // (text, is a delimiter)
      std::size_t at = 0;
      for (auto [b, e] : regex.matches(text)) {
        if (b > at) parts.push_back({text.substr(at, b - at), invert});
        parts.push_back({text.substr(b, e - b), !invert});
        at = e;
      }
      if (at < text.size()) parts.push_back({text.substr(at), invert});
      for (std::size_t i = 0; i < parts.size(); ++i) {
        auto [part, delimiter] = parts[i];
        if (!delimiter || behavior == SplitBehavior::kIsolated) {
          out.push_back(part);
        } else if (behavior == SplitBehavior::kMergedWithPrevious && !out.empty() && i > 0 &&
                   !parts[i - 1].second) {
          out.back() = std::string_view(out.back().data(), out.back().size() + part.size());
        } else if (behavior == SplitBehavior::kMergedWithNext && i + 1 < parts.size() &&
                   !parts[i + 1].second) {
          parts[i + 1].first = std::string_view(part.data(), part.size() + parts[i + 1].first.size());
        } else if (behavior != SplitBehavior::kRemoved) {
          out.push_back(part);
        }
      }
    }
    return out;
  }

  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const;

  BpeSpec spec_;
  std::int32_t vocab_size_ = 0;
  std::vector<bool> known_;                              // by id: some token has it
  std::vector<std::string> bytes_;                       // by id: what it decodes to
  std::unordered_map<std::string, std::int32_t> vocab_;  // byte-level text -> id
  std::vector<std::uint32_t> alphabet_;                  // byte -> code point
  std::int32_t byte_id_[256] = {};
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::vector<std::vector<const AddedToken*>> added_by_byte_;  // by first byte, longest first
  std::unique_ptr<Regex> gpt2_;
  bool removes_text_ = false;  // a Split that drops text, or an added token that strips whitespace
};

Status ByteLevelBpe::build(const std::string& where) {
  alphabet_ = byte_to_codepoint();
  const std::vector<std::uint32_t>& alphabet = alphabet_;
  std::unordered_map<std::uint32_t, int> byte_of;
  for (int b = 0; b < 256; ++b) byte_of[alphabet[static_cast<std::size_t>(b)]] = b;
  std::int32_t max_id = -1;
  for (const auto& [token, id] : spec_.vocab) max_id = std::max(max_id, id);
  for (const AddedToken& t : spec_.added) max_id = std::max(max_id, t.id);
  vocab_size_ = max_id + 1;
  known_.assign(static_cast<std::size_t>(vocab_size_), false);
  bytes_.assign(static_cast<std::size_t>(vocab_size_), "");
  std::vector<const std::string*> owner(static_cast<std::size_t>(vocab_size_), nullptr);
  for (const auto& [token, id] : spec_.vocab) {
    if (id < 0)
      return invalid_argument(where + ": token '" + token + "' has a negative id " + std::to_string(id));
    const auto i = static_cast<std::size_t>(id);
    if (owner[i] != nullptr) {
      return invalid_argument(where + ": token '" + token + "' has id " + std::to_string(id) +
                              ", which token '" + *owner[i] + "' already has; ids must be distinct");
    }
    owner[i] = &token;
    known_[i] = true;
    vocab_[token] = id;
    // The token's bytes: each code point of the alphabet is one byte (other characters, as in an
    // added token's entry, stand for themselves).
    std::string& bytes = bytes_[i];
    for (std::size_t k = 0; k < token.size();) {
      const std::size_t n = std::max<std::size_t>(1, utf8_length(token, k));
      std::uint32_t cp = static_cast<unsigned char>(token[k]);
      if (n == 2) cp = ((cp & 0x1Fu) << 6) | (static_cast<unsigned char>(token[k + 1]) & 0x3Fu);
      auto it = n <= 2 ? byte_of.find(cp) : byte_of.end();
      if (it != byte_of.end()) {
        bytes += static_cast<char>(it->second);
      } else {
        bytes.append(token, k, n);
      }
      k += n;
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, alphabet[static_cast<std::size_t>(b)]);
    auto it = vocab_.find(s);
    if (it == vocab_.end()) {
      return invalid_argument(where + ": the vocabulary lacks the single-byte token for byte " +
                              std::to_string(b) + " ('" + s + "'); a byte-level BPE needs all 256");
    }
    byte_id_[b] = it->second;
  }
  for (std::size_t r = 0; r < spec_.merges.size(); ++r) {
    const auto& [a, b] = spec_.merges[r];
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end()) {
      const std::string& missing = ia == vocab_.end() ? a : ib == vocab_.end() ? b : a + b;
      return invalid_argument(where + ": merge " + std::to_string(r) + " ('" + a + " " + b +
                              "') needs token '" + missing + "', which the vocabulary lacks");
    }
    // A pair listed twice keeps its best rank.
    merges_.emplace(pair_key(ia->second, ib->second), Merge{static_cast<std::int32_t>(r), iab->second});
  }
  added_by_byte_.assign(256, {});
  for (const AddedToken& t : spec_.added) {
    if (t.content.empty())
      return invalid_argument(where + ": added token " + std::to_string(t.id) + " is empty");
    known_[static_cast<std::size_t>(t.id)] = true;
    bytes_[static_cast<std::size_t>(t.id)] = t.content;
    added_by_byte_[static_cast<unsigned char>(t.content[0])].push_back(&t);
    if (t.lstrip || t.rstrip) removes_text_ = true;
  }
  for (auto& list : added_by_byte_) {
    std::stable_sort(list.begin(), list.end(), [](const AddedToken* x, const AddedToken* y) {
      return x->content.size() > y->content.size();
    });
  }
  for (const SplitStep& s : spec_.splits) {
    if (s.behavior == SplitBehavior::kRemoved) removes_text_ = true;
  }
  if (spec_.byte_level_regex) {
    STRATA_ASSIGN_OR_RETURN(Regex re, Regex::compile(std::string(kGpt2Pattern), false));
    gpt2_ = std::make_unique<Regex>(std::move(re));
  }
  return ok_status();
}

void ByteLevelBpe::encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
  if (piece.empty()) return;
  if (spec_.ignore_merges) {
    std::string whole;
    for (unsigned char c : piece) append_utf8(whole, alphabet_[c]);
    if (auto it = vocab_.find(whole); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Symbols in a linked list; candidate merges in a heap by (rank, position). A candidate is
  // stale once either of its symbols has been merged away; it is skipped then.
  const std::size_t n = piece.size();
  std::vector<std::int32_t> sym(n);
  std::vector<std::int64_t> prev(n), next(n);
  for (std::size_t i = 0; i < n; ++i) {
    sym[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    prev[i] = static_cast<std::int64_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<std::int64_t>(i + 1) : -1;
  }
  struct Candidate {
    std::int32_t rank;
    std::int64_t pos;
    std::int32_t left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](std::int64_t i) {
    if (i < 0 || next[static_cast<std::size_t>(i)] < 0) return;
    const std::int32_t l = sym[static_cast<std::size_t>(i)];
    const std::int32_t r = sym[static_cast<std::size_t>(next[static_cast<std::size_t>(i)])];
    if (auto it = merges_.find(pair_key(l, r)); it != merges_.end()) heap.push({it->second.rank, i, l, r});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) offer(static_cast<std::int64_t>(i));
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const auto i = static_cast<std::size_t>(c.pos);
    if (sym[i] != c.left || next[i] < 0 || sym[static_cast<std::size_t>(next[i])] != c.right) continue;
    const auto j = static_cast<std::size_t>(next[i]);
    sym[i] = merges_.at(pair_key(c.left, c.right)).id;
    sym[j] = -1;  // gone
    next[i] = next[j];
    if (next[j] >= 0) prev[static_cast<std::size_t>(next[j])] = static_cast<std::int64_t>(i);
    offer(prev[i]);
    offer(static_cast<std::int64_t>(i));
  }
  for (std::int64_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)])
    out.push_back(sym[static_cast<std::size_t>(i)]);
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> make_byte_level_bpe(BpeSpec spec, const std::string& where) {
  auto tok = std::make_unique<ByteLevelBpe>(std::move(spec));
  STRATA_RETURN_IF_ERROR(tok->build(where));
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

}  // namespace strata::data
