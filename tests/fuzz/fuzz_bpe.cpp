// libFuzzer target: the GPT-2 BPE tokenizer, loading vocab.json and merges.txt, then encoding.
// The input is three parts separated by NUL bytes: vocab text, merges text, text to encode. When
// the first byte is odd the vocab part is added (as a JSON object of token -> id) to the full
// byte alphabet, so that inputs get past the alphabet check and reach the merges and encode;
// otherwise it is the vocab file as is. A tokenizer that loads must encode any text to ids that
// decode back to exactly that text (byte-level BPE is lossless).
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "strata/data.hpp"

namespace {

std::string scratch(const char* name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/strata-fuzz-bpe-" +
         std::to_string(::getpid()) + "-" + name;
}

void write(const std::string& path, std::string_view text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), f) != text.size()) std::abort();
  std::fclose(f);
}

// GPT-2's byte alphabet: printable bytes stand for themselves, the others for U+0100 onwards.
nlohmann::json byte_alphabet() {
  nlohmann::json vocab = nlohmann::json::object();
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const std::uint32_t cp = direct ? static_cast<std::uint32_t>(b) : next++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[s] = b;
  }
  return vocab;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool with_alphabet = (data[0] & 1) != 0;
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto cut = [&rest] {
    const std::size_t nul = rest.find('\0');
    const std::string_view part = rest.substr(0, nul);
    rest = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
    return part;
  };
  const std::string_view vocab_part = cut(), merges_part = cut(), text = rest;

  static const std::string vocab_path = scratch("vocab.json"), merges_path = scratch("merges.txt");
  if (with_alphabet) {
    nlohmann::json vocab = byte_alphabet();
    const nlohmann::json extra = nlohmann::json::parse(vocab_part, nullptr, false);
    if (extra.is_object()) {
      for (auto it = extra.begin(); it != extra.end(); ++it) {
        if (!vocab.contains(it.key())) vocab[it.key()] = it.value();
      }
    }
    write(vocab_path, vocab.dump());
  } else {
    write(vocab_path, vocab_part);
  }
  write(merges_path, merges_part);
  auto tokenizer = strata::load_bpe_tokenizer(vocab_path, merges_path);
  if (!tokenizer.ok()) {
    if (tokenizer.status().message().empty()) std::abort();
    return 0;
  }
  const std::vector<std::int32_t> ids = (*tokenizer)->encode(text);
  auto decoded = (*tokenizer)->decode(ids);
  if (!decoded.ok() || *decoded != text) std::abort();
  return 0;
}
