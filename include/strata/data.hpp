// Training data: tokenizers (byte-level, GPT-2 BPE), the built-in corpus, and deterministic
// batching.
//
// The built-in corpus needs nothing downloaded: Strata generates it from a seed — arithmetic
// sentences, sentences from a small grammar with number agreement, and counting runs — text
// with structure a small model can learn, far below the unigram entropy. Its train/validation
// split is fixed (every tenth document is validation).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::int32_t vocab_size() const = 0;
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // Fails for an id outside [0, vocab_size()).
  virtual Result<std::string> decode(const std::vector<std::int32_t>& ids) const = 0;
  virtual std::string name() const = 0;
};

// One token per byte: vocab 256, lossless for any input.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// GPT-2 byte-level BPE from its two files: vocab.json ({"token": id, ...}, tokens written in
// GPT-2's byte-to-unicode alphabet) and merges.txt (an optional "#version" line, then one
// "left right" merge per line, best first). Pre-tokenization follows GPT-2's pattern
// (contractions, optional-space + letters / digits / other symbols, whitespace runs), with every
// byte >= 0x80 counted as a letter. Errors name the file and line or key.
Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& vocab_path, const std::string& merges_path);

struct Corpus {
  std::string train;
  std::string validation;
};

// The built-in corpus (deterministic for a given seed; about `bytes` bytes in all).
Corpus builtin_corpus(std::uint64_t seed = 1234, std::size_t bytes = 2u << 20);

// A text file split 90/10 at a line boundary. Errors name the path.
Result<Corpus> load_text_corpus(const std::string& path);

// Entropy (nats/token) of the unigram distribution of `tokens`: the loss of a model that only
// knows token frequencies — the baseline training must beat by far.
double unigram_entropy(const std::vector<std::int32_t>& tokens, std::int32_t vocab_size);

// Batches of B windows of T+1 consecutive tokens (inputs are the first T, targets the last T).
// Batch `index` depends only on (seed, index), so a resumed run sees the same batches.
class Batcher {
 public:
  // Fails when the token stream is shorter than T+1.
  static Result<Batcher> create(std::vector<std::int32_t> tokens, std::int64_t B, std::int64_t T, std::uint64_t seed);

  // inputs and targets: B*T ids each, row-major (B, T).
  void batch(std::uint64_t index, std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets) const;
  // Consecutive non-overlapping windows of T+1 tokens from the start (for evaluation); a
  // partial window at the end is dropped. Window w covers tokens [w*(T+1), w*(T+1) + T].
  std::int64_t eval_windows() const;
  void eval_window(std::int64_t w, std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets) const;

  std::int64_t batch_size() const { return B_; }
  std::int64_t seq_len() const { return T_; }
  const std::vector<std::int32_t>& tokens() const { return tokens_; }

 private:
  Batcher() = default;
  std::vector<std::int32_t> tokens_;
  std::int64_t B_ = 0;
  std::int64_t T_ = 0;
  std::uint64_t seed_ = 0;
};

}  // namespace strata
