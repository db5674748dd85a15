// Training data: tokenizers, token files, the built-in corpus, and deterministic batching
// (src/data; docs/training.md, "Data").
//
// Two paths feed a model. The demo path holds a text in memory: the built-in corpus (generated
// from a seed: arithmetic sentences, sentences from a small grammar with number agreement and
// counting runs, far below the unigram entropy; every tenth document is validation) or a text
// file, tokenized whole and batched by Batcher. The path for real data never reads a dataset
// whole: token files (nanoGPT's flat uint16 `train.bin`, flat uint32, llm.c's headered `.bin`),
// one or many shards, memory-mapped by TokenDataset and cut into windows by WindowSampler, whose
// position is a single counter that checkpoints store. `strata tokenize` writes such files with
// the tokenizers below.
//
// Thread safety: a Tokenizer, a TokenDataset and a WindowSampler are immutable once built; their
// const methods may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.hpp"

namespace strata {

// ---- tokenizers ---------------------------------------------------------------------------------

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // One more than the largest id the tokenizer produces (its added tokens included).
  virtual std::int32_t vocab_size() const = 0;
  // The text's ids, without the bos/eos a sequence may start or end with (see adds_bos()).
  // Never fails: text that is not valid UTF-8 is encoded too (byte-level BPE keeps every byte;
  // SentencePiece turns an invalid byte into U+FFFD first).
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // Fails for an id outside [0, vocab_size()) or one that no token has.
  virtual Result<std::string> decode(const std::vector<std::int32_t>& ids) const = 0;
  // "bytes", "gpt2-bpe", or the kind and file of a loaded tokenizer ("tokenizer.json:PATH").
  virtual std::string name() const = 0;

  // The beginning- and end-of-sequence ids as the tokenizer's configuration names them; -1 when
  // it has none.
  virtual std::int32_t bos_id() const { return -1; }
  virtual std::int32_t eos_id() const { return -1; }
  // Whether the configuration puts bos before (eos after) every encoded sequence: the
  // post-processor of tokenizer.json, add_bos_token/add_eos_token of tokenizer_config.json, or
  // SentencePiece's convention (bos, no eos).
  virtual bool adds_bos() const { return false; }
  virtual bool adds_eos() const { return false; }
  // Whether decode(encode(text)) == text is guaranteed for every text (byte tokens; byte-level
  // BPE without a normalizer). Where it is not, the text may still round-trip.
  virtual bool round_trips() const { return false; }
};

// One token per byte: vocab 256, lossless for any input.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// GPT-2 byte-level BPE from its two files: vocab.json ({"token": id, ...}, tokens written in
// GPT-2's byte-to-unicode alphabet) and merges.txt (an optional "#version" line, then one
// "left right" merge per line, best first). Pre-tokenization is GPT-2's published pattern (through
// PCRE2, with Unicode properties). Errors name the file and line or key.
Result<std::unique_ptr<Tokenizer>> load_bpe_tokenizer(const std::string& vocab_path,
                                                      const std::string& merges_path);

// Any tokenizer Strata reads, by what `path` is:
//   - a Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, LLaMA 3, Qwen2, ...);
//     a tokenizer_config.json beside it supplies bos/eos and add_bos_token/add_eos_token;
//   - a SentencePiece model (tokenizer.model of LLaMA 2, Mistral, ...), through the
//     SentencePiece library; tokenizer_config.json beside it likewise;
//   - a GPT-2 vocab.json (merges.txt beside it);
//   - a directory holding tokenizer.json, tokenizer.model or vocab.json + merges.txt (first found);
//   - the word "bytes": the byte tokenizer.
// A configuration this build does not implement exactly (another model type, normalizer,
// pre-tokenizer or post-processor) is refused naming the key and value. Errors name the file.
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);

// ---- the built-in corpus and text files -----------------------------------------------------------

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
double unigram_entropy(std::span<const std::int32_t> tokens, std::int32_t vocab_size);

// Batches of B windows of T+1 consecutive tokens (inputs are the first T, targets the last T).
// Batch `index` depends only on (seed, index), so a resumed run sees the same batches.
class Batcher {
 public:
  // Fails when the token stream is shorter than T+1.
  static Result<Batcher> create(std::vector<std::int32_t> tokens, std::int64_t B, std::int64_t T,
                                std::uint64_t seed);

  // inputs and targets: B*T ids each, row-major (B, T).
  void batch(std::uint64_t index, std::vector<std::int32_t>& inputs,
             std::vector<std::int32_t>& targets) const;
  // Consecutive non-overlapping windows of T+1 tokens from the start (for evaluation); a
  // partial window at the end is dropped. Window w covers tokens [w*(T+1), w*(T+1) + T].
  std::int64_t eval_windows() const;
  void eval_window(std::int64_t w, std::vector<std::int32_t>& inputs,
                   std::vector<std::int32_t>& targets) const;

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

// ---- token files ----------------------------------------------------------------------------------

enum class TokenDType { kU16, kU32 };
std::string_view to_string(TokenDType t);
Result<TokenDType> parse_token_dtype(std::string_view s);  // "u16" | "u32"
inline std::size_t token_bytes(TokenDType t) { return t == TokenDType::kU16 ? 2 : 4; }

// The layouts a token file may have. Flat files are bare little-endian ids (nanoGPT's
// train.bin: uint16); their width comes from the caller (or the sidecar FILE.json that
// `strata tokenize` writes). llm.c's files start with 256 little-endian int32: magic, version,
// token count, then zeros; the magic says the width (20240520 version 1: uint16, "gpt-2";
// 20240801 version 7: uint32, "llama-3"), and the count must match the file's size.
enum class TokenFormat { kFlat, kLlmc };
inline constexpr std::int32_t kLlmcMagicU16 = 20240520;
inline constexpr std::int32_t kLlmcVersionU16 = 1;
inline constexpr std::int32_t kLlmcMagicU32 = 20240801;
inline constexpr std::int32_t kLlmcVersionU32 = 7;
inline constexpr std::size_t kLlmcHeaderBytes = 256 * 4;

struct TokenFileInfo {
  std::string path;
  TokenFormat format = TokenFormat::kFlat;
  TokenDType dtype = TokenDType::kU16;
  std::uint64_t header_bytes = 0;  // where the ids start
  std::uint64_t tokens = 0;
};

// The sidecar `strata tokenize` writes beside FILE: FILE.json with the width, the count and the
// tokenizer (its name, vocabulary size, bos and eos ids). Absent: nullopt. A sidecar that exists
// but does not parse, or disagrees with its file's size, is an error naming it.
struct TokenFileMeta {
  TokenDType dtype = TokenDType::kU16;
  std::uint64_t tokens = 0;
  std::string tokenizer;
  std::int32_t vocab_size = 0;
  std::int32_t bos_id = -1, eos_id = -1;
};
std::string token_meta_path(const std::string& token_file);
Result<std::optional<TokenFileMeta>> read_token_meta(const std::string& token_file);

// "a.bin", "a.bin,b.bin" or a glob ("shards/train_*.bin", sorted by name), in that order; every
// entry must name at least one file. Errors name the entry.
Result<std::vector<std::string>> expand_token_paths(std::string_view spec);

struct TokenDatasetOptions {
  // The width of flat files; nullopt: each file's sidecar, else uint16 (nanoGPT). llm.c files
  // carry their own (a header that contradicts `dtype` is an error naming the file).
  std::optional<TokenDType> dtype;
  // Ids must be < vocab_limit (0: < 2^31); read() fails naming file and offset otherwise.
  std::int64_t vocab_limit = 0;
};

// One or more token files read as one stream (the files in order), memory-mapped and never read
// whole: read() touches only the pages of the tokens it copies. Movable, not copyable.
class TokenDataset {
 public:
  static Result<TokenDataset> open(const std::vector<std::string>& paths,
                                   const TokenDatasetOptions& options = {});
  TokenDataset(TokenDataset&&) noexcept;
  TokenDataset& operator=(TokenDataset&&) noexcept;
  ~TokenDataset();

  std::uint64_t size() const;  // tokens, all files
  const std::vector<TokenFileInfo>& files() const;
  std::int64_t vocab_limit() const;
  void set_vocab_limit(std::int64_t limit);
  // "a.bin" or "a.bin (+3 more)".
  std::string describe() const;

  // Tokens [begin, begin + out.size()) as int32, across file boundaries. Fails past the end,
  // and for an id >= vocab_limit naming the file, the token's index in it and its byte offset.
  Status read(std::uint64_t begin, std::span<std::int32_t> out) const;

 private:
  struct Impl;
  explicit TokenDataset(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes a token file: flat (bare ids) or llm.c's header, then a FILE.json sidecar. The data goes
// to FILE.tmp, renamed over FILE by finish(), so a run that fails leaves no partial FILE. An id
// that does not fit the width is an error naming it.
class TokenWriter {
 public:
  static Result<TokenWriter> create(const std::string& path, TokenDType dtype, TokenFormat format);
  TokenWriter(TokenWriter&&) noexcept;
  TokenWriter& operator=(TokenWriter&&) noexcept;
  ~TokenWriter();  // removes FILE.tmp unless finish() succeeded

  Status append(std::span<const std::int32_t> ids);
  std::uint64_t tokens() const;
  // Flushes, fixes the header's count, writes the sidecar (`meta`'s dtype and count are set
  // here) and renames the file into place.
  Status finish(TokenFileMeta meta);

 private:
  struct Impl;
  explicit TokenWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Training windows of T+1 tokens over a dataset of n tokens. An epoch is the N = (n-1)/T windows
// that start at offset_e + k*T (k < N; consecutive windows share one token, so each token but the
// first is a target once per epoch), visited in a pseudo-random order. offset_e in [0, slack]
// (slack = n-1 - N*T) and the order both come from (seed, e) alone: the order is a keyed
// permutation (a Feistel network over [0, N), no table), so window number i — epoch i / N,
// position i % N — is found in O(1) and a run's position is the one counter `i`.
class WindowSampler {
 public:
  // Fails (naming the dataset) when it holds fewer than T+1 tokens. `data` must outlive the
  // sampler and stay where it is.
  static Result<WindowSampler> create(const TokenDataset& data, std::int64_t T, std::uint64_t seed);

  std::uint64_t windows_per_epoch() const { return windows_; }
  std::int64_t seq_len() const { return T_; }
  // The first token of window number `index` (counted over all epochs).
  std::uint64_t window_start(std::uint64_t index) const;
  // A (B, T) batch, row b from window number first + b; errors are TokenDataset::read's.
  Status batch(std::uint64_t first, std::int64_t B, std::vector<std::int32_t>& inputs,
               std::vector<std::int32_t>& targets) const;

 private:
  WindowSampler() = default;
  const TokenDataset* data_ = nullptr;
  std::int64_t T_ = 0;
  std::uint64_t seed_ = 0;
  std::uint64_t windows_ = 0;
  std::uint64_t slack_ = 0;
};

// A keyed pseudo-random permutation of [0, n): permute(x) for x < n is a bijection onto [0, n),
// a function of (key, x) alone. Exposed for tests.
std::uint64_t permute_index(std::uint64_t x, std::uint64_t n, std::uint64_t key);

}  // namespace strata
