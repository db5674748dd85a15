// The tokenizer loaders behind load_tokenizer (data.hpp). Private to src/data.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "strata/data.hpp"

namespace strata::data {

// What tokenizer_config.json (Hugging Face, beside the tokenizer file) says about special tokens;
// every field absent when the file or the key is.
struct SpecialTokensConfig {
  std::string path;                      // the file read, empty when there is none
  std::optional<std::string> bos_token;  // "" when the key is null
  std::optional<std::string> eos_token;
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
};

// Reads DIR/tokenizer_config.json for a tokenizer file in DIR. A file that exists but does not
// parse, or a key of the wrong type, is an error naming the file and key.
Result<SpecialTokensConfig> read_tokenizer_config(const std::string& tokenizer_path);

// A Hugging Face tokenizer.json with a byte-level BPE model (tokenizer_json.cpp).
Result<std::unique_ptr<Tokenizer>> load_tokenizer_json(const std::string& path);

// A SentencePiece model file (sentencepiece.cpp).
Result<std::unique_ptr<Tokenizer>> load_sentencepiece(const std::string& path);

}  // namespace strata::data
