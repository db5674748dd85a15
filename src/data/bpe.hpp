// Byte-level BPE, the model behind GPT-2's vocab.json/merges.txt and the Hugging Face
// tokenizer.json files of GPT-2, LLaMA 3 and Qwen2. Private to src/data.
//
// encode(text), in the order Hugging Face's tokenizers library applies it:
//   1. added tokens: the text is cut at every occurrence of an added token's content (leftmost,
//      then longest; lstrip/rstrip take the whitespace beside it along), which becomes its id;
//   2. each remaining segment is normalized (NFC through ICU when the file names it) and cut
//      into pieces by the pre-tokenizer's regex splits (PCRE2, UTF + Unicode properties), then
//      by the byte-level regex (GPT-2's pattern) when `use_regex`;
//   3. each piece's bytes become the byte alphabet's symbols (GPT-2's byte -> code point map),
//      and the adjacent pair of lowest merge rank is merged, leftmost first, until no pair has
//      a rank (with ignore_merges a piece that is a vocabulary entry as a whole is that entry).
// decode(ids) maps each token back through the alphabet; an added token decodes to its content.
// Text that is not valid UTF-8 is encoded too: the regexes never match an invalid byte, which
// then forms a piece of its own, and the byte alphabet covers every byte.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/data.hpp"

namespace strata::data {

// A compiled PCRE2 pattern (UTF, Unicode properties, invalid UTF-8 never matches). Immutable;
// for_each_match may run on several threads at once.
class Regex {
 public:
  static Result<Regex> compile(const std::string& pattern, bool literal);
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  ~Regex();
  // Non-empty matches in `text`, left to right, as [begin, end) byte offsets.
  std::vector<std::pair<std::size_t, std::size_t>> matches(std::string_view text) const;

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
};

// GPT-2's pre-tokenization pattern (the ByteLevel pre-tokenizer's `use_regex`).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// What a Split pre-tokenizer keeps of the matches and the text between them.
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext };

struct SplitStep {
  Regex regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;  // the pattern marks the pieces, not the delimiters
};

struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool lstrip = false;  // also takes the whitespace before it
  bool rstrip = false;  // ... and after it
};

struct BpeSpec {
  std::string name;
  std::vector<std::pair<std::string, std::int32_t>> vocab;  // tokens in the byte alphabet
  std::vector<std::pair<std::string, std::string>> merges;  // best first
  bool ignore_merges = false;
  bool nfc = false;
  std::vector<SplitStep> splits;
  bool byte_level_regex = true;  // the ByteLevel pre-tokenizer's use_regex
  bool add_prefix_space = false;
  std::vector<AddedToken> added;
  std::int32_t bos = -1, eos = -1;
  bool adds_bos = false, adds_eos = false;
};

// Checks the spec (every byte of the alphabet in the vocabulary, ids distinct, each merge's
// parts and result in the vocabulary) and builds the tokenizer. Errors start with `where`.
Result<std::unique_ptr<Tokenizer>> make_byte_level_bpe(BpeSpec spec, const std::string& where);

// GPT-2's byte -> code point map: printable bytes stand for themselves, the others for U+0100
// onwards, so that every token is printable text in the vocabulary files.
std::vector<std::uint32_t> byte_to_codepoint();
void append_utf8(std::string& out, std::uint32_t cp);
// Length of the valid UTF-8 sequence at text[i] (1-4), or 0 when the byte there starts none.
std::size_t utf8_length(std::string_view text, std::size_t i);

// NFC of `text` through ICU; bytes that are not valid UTF-8 are kept as they are and the runs
// between them normalized on their own.
std::string nfc(std::string_view text);

}  // namespace strata::data
