// libFuzzer target: the tokenizer.json reader (load_tokenizer) and the byte-level BPE it builds.
// Input: a tokenizer part and a text part, separated by the first NUL. When the first byte is
// odd, the tokenizer part is parsed as JSON and its keys are laid over a valid
// file (GPT-2's byte alphabet, a few merges, an added token, the LLaMA 3 Split regex), so that
// inputs reach the normalizer, pre-tokenizer, post-processor and added-token code; otherwise it
// is the file as is (when it starts with '{'). A tokenizer that loads must encode the text to ids below its
// vocabulary that decode again, to exactly the text where it promises a round trip; a refusal must name the
// file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "strata/data.hpp"

namespace {

std::string scratch() {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/strata-fuzz-tokenizer-" +
         std::to_string(::getpid()) + ".json";
}

void write(const std::string& path, std::string_view text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), f) != text.size()) std::abort();
  std::fclose(f);
}

std::string utf8(std::uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

nlohmann::json base() {
  nlohmann::json vocab = nlohmann::json::object();
  std::uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    vocab[utf8(direct ? static_cast<std::uint32_t>(b) : next++)] = b;
  }
  vocab["he"] = 256;
  vocab["\xc4\xa0t"] = 257;  // "Ġt"
  vocab["\xc4\xa0the"] = 258;
  const char* llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  nlohmann::json j;
  j["added_tokens"] = nlohmann::json::array({{{"id", 259}, {"content", "<|eot|>"}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       nlohmann::json::array({{{"type", "Split"}, {"pattern", {{"Regex", llama3}}}, {"behavior", "Isolated"}},
                              {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"},
                {"vocab", vocab},
                {"merges", nlohmann::json::array({"h e", "\xc4\xa0 t", "\xc4\xa0t he"})}};
  return j;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool overlay = (data[0] & 1) != 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::size_t nul = rest.find('\0');
  const std::string_view part = rest.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  static const std::string path = scratch();
  if (overlay) {
    nlohmann::json j = base();
    const nlohmann::json extra = nlohmann::json::parse(part, nullptr, false);
    if (extra.is_object()) {
      for (auto it = extra.begin(); it != extra.end(); ++it) {
        if (it.key() == "model" && it.value().is_object()) {
          for (auto m = it.value().begin(); m != it.value().end(); ++m) j["model"][m.key()] = m.value();
        } else {
          j[it.key()] = it.value();
        }
      }
    }
    write(path, j.dump());
  } else {
    if (part.empty() || part[0] != '{')
      return 0;  // not JSON: the SentencePiece library's input, not this reader's
    write(path, part);
  }
  auto tok = strata::load_tokenizer(path);
  if (!tok.ok()) {
    if (tok.status().message().find(path) == std::string::npos) std::abort();  // names the file
    return 0;
  }
  const std::vector<std::int32_t> ids = (*tok)->encode(text);
  for (std::int32_t id : ids) {
    if (id < 0 || id >= (*tok)->vocab_size()) std::abort();
  }
  auto decoded = (*tok)->decode(ids);
  if (!decoded.ok()) std::abort();
  if ((*tok)->round_trips() && *decoded != text) std::abort();
  return 0;
}
