// The data of `strata train`: the demo text (the built-in corpus or --data, tokenized whole and
// batched by Batcher), or token files (--tokens, memory-mapped and cut into windows by
// WindowSampler, data.hpp). Private to tools/strata.
//
// Both hand out the micro-batches of a step the same way: micro-batch m of step s (m < A x DP,
// the step's micro-batches over every data-parallel rank; rank r trains m = a x DP + r) is
//   text:   Batcher batch number s x A x DP + m;
//   tokens: windows position + ((s - first) x A x DP + m) x B ... + B - 1, where `position`
//           is the window counter at the first step this process trains (0, or a checkpoint's).
// So N ranks with accumulation A see the batches of one process with A x N, and a resumed run
// continues exactly. A token run's checkpoints store the counter ("data_position"): a run may
// resume with another batch shape or rank count and go on from the next unseen window.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.hpp"
#include "strata/data.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"

namespace strata::cli {

inline constexpr FlagSpec kTrainDataFlags[] = {
    {"data", "FILE", "train on a text file (split 90/10 at a line boundary) instead of the built-in corpus"},
    {"val-data", "FILE", "validate on this text file instead of the split"},
    {"tokens", "FILE[,FILE...]",
     "train on token files, never read whole: nanoGPT's flat .bin (u16), flat u32, llm.c's headered .bin; a "
     "comma list and globs (shards/train_*.bin) are read in order as one stream (strata tokenize writes "
     "them)"},
    {"val-tokens", "FILE[,FILE...]", "validate on these token files (with --tokens; default: no validation)"},
    {"token-dtype", "u16|u32",
     "width of flat token files (default: each file's .json sidecar from strata tokenize, else u16)"},
    {"vocab-size", "N",
     "the model's vocabulary with --tokens (default: --tokenizer's, else the token files' sidecar)"},
    {"tokenizer", "FILE",
     "tokenizer.json, tokenizer.model, vocab.json or a directory (strata tokenize reads the same): tokenizes "
     "--data; "
     "with --tokens it gives the vocabulary size"},
    {"vocab", "FILE", "GPT-2 BPE vocab.json (with --merges); default: byte tokens"},
    {"merges", "FILE", "GPT-2 BPE merges.txt (with --vocab)"},
};

struct TrainDataShape {
  std::int64_t micro_batch = 1;  // B
  std::int64_t seq_len = 1;      // T
  std::uint64_t seed = 0;
  std::int64_t micro_batches_per_step = 1;  // A x DP, over every data-parallel rank
};

class TrainData {
 public:
  // The data flags' combinations and values; an error is a usage error naming the flag.
  static Status check_flags(const Args& args);
  // Loads the data (after check_flags); errors name the file.
  static Result<std::unique_ptr<TrainData>> load(const Args& args, const TrainDataShape& shape);
  virtual ~TrainData() = default;

  virtual std::string name() const = 0;            // the header's and run.json's "data"
  virtual std::string tokenizer_name() const = 0;  // "bytes", a tokenizer file, or "token ids"
  // The vocabulary the data asks for; 0 when it cannot tell (the model's config then decides).
  virtual std::int32_t vocab_size() const = 0;
  // Ids must lie below the model's vocabulary; token files are checked as they are read.
  virtual void set_model_vocab(std::int32_t vocab) = 0;
  virtual std::uint64_t train_tokens() const = 0;
  virtual std::uint64_t validation_tokens() const = 0;
  // The unigram entropy of the training tokens (of a sample of ~1M tokens spread over token
  // files), and a note on how it was measured ("" or "sample of N tokens").
  virtual double unigram() const = 0;
  virtual std::string unigram_note() const { return ""; }
  virtual std::string describe() const;  // the header's data line

  // Micro-batch m (< micro_batches_per_step) of `step`: (B, T) inputs and targets.
  virtual Status batch(std::int64_t step, std::int64_t m, std::vector<std::int32_t>& inputs,
                       std::vector<std::int32_t>& targets) = 0;
  // The validation loss over the first `max_windows` windows of T+1 tokens (0 = all).
  virtual bool can_validate() const = 0;
  virtual Result<EvalResult> validate(OffloadEngine& engine, std::int64_t max_windows) = 0;

  // What a checkpoint must agree on to be resumed (compared key by key).
  virtual nlohmann::ordered_json identity() const = 0;
  // The position after `step` (0-based) for a checkpoint's client state; null when the
  // position follows from the step alone (text).
  virtual nlohmann::ordered_json position_after(std::int64_t step) const = 0;
  // Continues from a checkpoint of step `first_step` whose client state is `saved`.
  virtual Status resume(std::int64_t first_step, const nlohmann::ordered_json& saved) = 0;
};

}  // namespace strata::cli
