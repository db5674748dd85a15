// strata train's data (train_data.hpp): the demo text and token files.
#include "train_data.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "model_flags.hpp"
#include "strata/nvme.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;

std::string thousands(std::uint64_t v) {
  std::string digits = std::to_string(v), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// The tokenizer of the text path: --tokenizer, --vocab/--merges, or bytes.
Result<std::unique_ptr<Tokenizer>> text_tokenizer(const Args& args) {
  if (auto t = args.get("tokenizer")) return load_tokenizer(*t);
  if (args.has("vocab")) return load_bpe_tokenizer(*args.get("vocab"), *args.get("merges"));
  return make_byte_tokenizer();
}

// ---- the demo text ------------------------------------------------------------------------------

class TextData final : public TrainData {
 public:
  static Result<std::unique_ptr<TrainData>> load(const Args& args, const TrainDataShape& shape) {
    auto d = std::make_unique<TextData>();
    d->shape_ = shape;
    STRATA_ASSIGN_OR_RETURN(d->tokenizer_, text_tokenizer(args));
    Corpus corpus;
    if (auto path = args.get("data")) {
      STRATA_ASSIGN_OR_RETURN(corpus, load_text_corpus(*path));
      d->name_ = *path;
    } else {
      corpus = builtin_corpus();
      d->name_ = "built-in corpus";
    }
    if (auto path = args.get("val-data")) {
      std::ifstream in(*path, std::ios::binary);
      if (!in) return not_found("--val-data file '" + *path + "' cannot be opened");
      std::stringstream ss;
      ss << in.rdbuf();
      corpus.validation = ss.str();
    }
    d->train_ = d->tokenizer_->encode(corpus.train);
    d->validation_ = d->tokenizer_->encode(corpus.validation);
    d->unigram_ = unigram_entropy(d->train_, d->tokenizer_->vocab_size());
    auto batcher = Batcher::create(d->train_, shape.micro_batch, shape.seq_len, shape.seed);
    if (!batcher.ok()) return batcher.status().with_context("training data (" + d->name_ + ")");
    d->batcher_.emplace(std::move(*batcher));
    return std::unique_ptr<TrainData>(std::move(d));
  }

  std::string name() const override { return name_; }
  std::string tokenizer_name() const override { return tokenizer_->name(); }
  std::int32_t vocab_size() const override { return tokenizer_->vocab_size(); }
  void set_model_vocab(std::int32_t) override {}  // the tokenizer's ids are below its size
  std::uint64_t train_tokens() const override { return train_.size(); }
  std::uint64_t validation_tokens() const override { return validation_.size(); }
  double unigram() const override { return unigram_; }

  Status batch(std::int64_t step, std::int64_t m, std::vector<std::int32_t>& inputs,
               std::vector<std::int32_t>& targets) override {
    batcher_->batch(static_cast<std::uint64_t>(step * shape_.micro_batches_per_step + m), inputs, targets);
    return ok_status();
  }
  bool can_validate() const override {
    return static_cast<std::int64_t>(validation_.size()) > shape_.seq_len;
  }
  Result<EvalResult> validate(OffloadEngine& engine, std::int64_t max_windows) override {
    return engine.evaluate(validation_, max_windows);
  }

  // Batcher's batch i depends only on (tokens, B, T, seed).
  Json identity() const override {
    Json id;
    id["data"] = name_;
    id["tokenizer"] = tokenizer_->name();
    id["train_tokens"] = train_.size();
    id["train_tokens_crc32c"] = crc32c(train_.data(), train_.size() * sizeof(std::int32_t));
    id["micro_batch"] = shape_.micro_batch;
    id["grad_accum"] = shape_.micro_batches_per_step;  // over all data-parallel ranks
    id["seq_len"] = shape_.seq_len;
    id["seed"] = shape_.seed;
    return id;
  }
  Json position_after(std::int64_t) const override { return nullptr; }
  Status resume(std::int64_t, const Json&) override { return ok_status(); }

 private:
  TrainDataShape shape_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string name_;
  std::vector<std::int32_t> train_, validation_;
  std::optional<Batcher> batcher_;
  double unigram_ = 0;
};

// ---- token files --------------------------------------------------------------------------------

// Validation windows are evaluated this many at a time (a multiple of the micro-batch), so that
// only one chunk of the validation files is in memory.
constexpr std::int64_t kValChunkWindows = 4096;
// The unigram entropy of token files is measured over about this many tokens.
constexpr std::uint64_t kUnigramSample = 1u << 20;

class TokenData final : public TrainData {
 public:
  static Result<std::unique_ptr<TrainData>> load(const Args& args, const TrainDataShape& shape) {
    auto d = std::make_unique<TokenData>();
    d->shape_ = shape;
    TokenDatasetOptions options;
    if (auto t = args.get("token-dtype")) {
      auto dtype = parse_token_dtype(*t);
      if (!dtype.ok()) return dtype.status().with_context("flag '--token-dtype'");
      options.dtype = *dtype;
    }
    STRATA_ASSIGN_OR_RETURN(std::vector<std::string> paths, expand_token_paths(*args.get("tokens")));
    STRATA_ASSIGN_OR_RETURN(TokenDataset train, TokenDataset::open(paths, options));
    d->train_ = std::make_unique<TokenDataset>(std::move(train));
    if (auto v = args.get("val-tokens")) {
      STRATA_ASSIGN_OR_RETURN(std::vector<std::string> vpaths, expand_token_paths(*v));
      STRATA_ASSIGN_OR_RETURN(TokenDataset val, TokenDataset::open(vpaths, options));
      d->validation_ = std::make_unique<TokenDataset>(std::move(val));
    }
    auto sampler = WindowSampler::create(*d->train_, shape.seq_len, shape.seed);
    if (!sampler.ok()) return sampler.status().with_context("--tokens");
    d->sampler_.emplace(std::move(*sampler));
    STRATA_RETURN_IF_ERROR(d->find_vocab(args, paths.front()));
    return std::unique_ptr<TrainData>(std::move(d));
  }

  std::string name() const override { return train_->describe(); }
  std::string tokenizer_name() const override { return tokenizer_.empty() ? "token ids" : tokenizer_; }
  std::int32_t vocab_size() const override { return vocab_; }
  void set_model_vocab(std::int32_t vocab) override {
    train_->set_vocab_limit(vocab);
    if (validation_) validation_->set_vocab_limit(vocab);
  }
  std::uint64_t train_tokens() const override { return train_->size(); }
  std::uint64_t validation_tokens() const override { return validation_ ? validation_->size() : 0; }

  double unigram() const override {
    if (!unigram_) measure_unigram();
    return *unigram_;
  }
  std::string unigram_note() const override {
    return unigram_tokens_ < train_->size() ? "sample of " + thousands(unigram_tokens_) + " tokens" : "";
  }
  std::string describe() const override {
    std::string files;
    for (const TokenFileInfo& f : train_->files()) {
      files += std::string(files.empty() ? "" : ", ") + std::string(to_string(f.dtype)) +
               (f.format == TokenFormat::kLlmc ? " llm.c" : "");
    }
    return TrainData::describe() + "; " + std::to_string(train_->files().size()) + " file(s) (" + files +
           "), " + thousands(sampler_->windows_per_epoch()) + " windows per epoch";
  }

  Status batch(std::int64_t step, std::int64_t m, std::vector<std::int32_t>& inputs,
               std::vector<std::int32_t>& targets) override {
    const std::uint64_t first = window_of(step, m);
    Status s = sampler_->batch(first, shape_.micro_batch, inputs, targets);
    if (!s.ok()) return s.with_context("--tokens, windows " + std::to_string(first) + "..");
    return s;
  }

  bool can_validate() const override {
    return validation_ && validation_->size() >= static_cast<std::uint64_t>(shape_.seq_len) + 1;
  }

  // The windows strata eval counts: consecutive, non-overlapping, T+1 tokens each, from the
  // start; read and evaluated a chunk at a time, the chunks' losses combined by their tokens.
  Result<EvalResult> validate(OffloadEngine& engine, std::int64_t max_windows) override {
    const std::int64_t T1 = shape_.seq_len + 1;
    std::int64_t windows = static_cast<std::int64_t>(validation_->size() / static_cast<std::uint64_t>(T1));
    if (max_windows > 0) windows = std::min(windows, max_windows);
    const std::int64_t chunk =
        std::max<std::int64_t>(1, kValChunkWindows / shape_.micro_batch) * shape_.micro_batch;
    std::vector<std::int32_t> tokens;
    double sum = 0;
    std::int64_t count = 0;
    for (std::int64_t w = 0; w < windows; w += chunk) {
      const std::int64_t n = std::min(chunk, windows - w);
      tokens.resize(static_cast<std::size_t>(n * T1));
      Status s = validation_->read(static_cast<std::uint64_t>(w * T1), tokens);
      if (!s.ok()) return s.with_context("--val-tokens");
      STRATA_ASSIGN_OR_RETURN(EvalResult r, engine.evaluate(tokens, 0));
      if (n == windows) return r;  // one chunk: the engine's own mean
      sum += r.loss * static_cast<double>(r.tokens);
      count += r.tokens;
    }
    if (count == 0) return invalid_argument("--val-tokens: no window of " + std::to_string(T1) + " tokens");
    return EvalResult{sum / static_cast<double>(count), count};
  }

  // The windows depend on the files, T and the seed; the batch shape and the ranks may change
  // across a resume (the position is a window counter).
  Json identity() const override {
    Json id;
    id["data"] = name();
    Json files = Json::array();
    for (const TokenFileInfo& f : train_->files()) files.push_back(file_identity(f));
    id["token_files"] = files;
    id["seq_len"] = shape_.seq_len;
    id["seed"] = shape_.seed;
    return id;
  }
  Json position_after(std::int64_t step) const override {
    const std::uint64_t windows = window_of(step + 1, 0);
    return Json{{"windows", windows},
                {"epoch", windows / sampler_->windows_per_epoch()},
                {"windows_per_epoch", sampler_->windows_per_epoch()}};
  }
  Status resume(std::int64_t first_step, const Json& saved) override {
    if (!saved.contains("data_position") || !saved["data_position"].contains("windows") ||
        !saved["data_position"]["windows"].is_number_unsigned()) {
      return failed_precondition(
          "the checkpoint has no data_position.windows (it was not trained on --tokens)");
    }
    first_step_ = first_step;
    position_ = saved["data_position"]["windows"].get<std::uint64_t>();
    return ok_status();
  }

 private:
  // The first window of micro-batch m of `step`.
  std::uint64_t window_of(std::int64_t step, std::int64_t m) const {
    const auto per_step = static_cast<std::uint64_t>(shape_.micro_batches_per_step);
    return position_ +
           (static_cast<std::uint64_t>(step - first_step_) * per_step + static_cast<std::uint64_t>(m)) *
               static_cast<std::uint64_t>(shape_.micro_batch);
  }

  // --vocab-size, else --tokenizer's, else the first file's sidecar; the tokenizer's name from
  // either.
  Status find_vocab(const Args& args, const std::string& first_file) {
    STRATA_ASSIGN_OR_RETURN(std::optional<TokenFileMeta> meta, read_token_meta(first_file));
    if (meta) {
      tokenizer_ = meta->tokenizer;
      vocab_ = meta->vocab_size;
    }
    if (auto t = args.get("tokenizer")) {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, load_tokenizer(*t));
      tokenizer_ = tok->name();
      vocab_ = tok->vocab_size();
    }
    std::int64_t v = vocab_;
    STRATA_RETURN_IF_ERROR(int_flag(args, "vocab-size", 1, (1ll << 31) - 1, &v));
    vocab_ = static_cast<std::int32_t>(v);
    return ok_status();
  }

  static Json file_identity(const TokenFileInfo& f) {
    // The first MiB's checksum tells a replaced file from the one trained on without reading it all.
    std::ifstream in(f.path, std::ios::binary);
    std::string head(1u << 20, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<std::size_t>(in.gcount()));
    return Json{{"path", f.path}, {"tokens", f.tokens}, {"head_crc32c", crc32c(head.data(), head.size())}};
  }

  // Over whole windows in the sampler's first-epoch order: spread over the files.
  void measure_unigram() const {
    const std::uint64_t T = static_cast<std::uint64_t>(shape_.seq_len);
    const std::uint64_t windows = std::min<std::uint64_t>(sampler_->windows_per_epoch(),
                                                          std::max<std::uint64_t>(1, kUnigramSample / T));
    std::vector<std::int32_t> all, in, tg;
    for (std::uint64_t w = 0; w < windows; ++w) {
      if (!sampler_->batch(w, 1, in, tg).ok()) break;  // a bad id: the first step will report it
      all.insert(all.end(), in.begin(), in.end());
    }
    unigram_tokens_ = all.size();
    std::int32_t vocab = vocab_;
    for (std::int32_t id : all) vocab = std::max(vocab, id + 1);
    unigram_ = unigram_entropy(all, vocab);
  }

  TrainDataShape shape_;
  std::unique_ptr<TokenDataset> train_, validation_;  // fixed addresses: the sampler keeps one
  std::optional<WindowSampler> sampler_;
  std::string tokenizer_;
  std::int32_t vocab_ = 0;
  std::int64_t first_step_ = 0;
  std::uint64_t position_ = 0;  // windows consumed before first_step_
  mutable std::optional<double> unigram_;
  mutable std::uint64_t unigram_tokens_ = 0;
};

}  // namespace

std::string TrainData::describe() const {
  const std::string note = unigram_note();
  char line[512];
  std::snprintf(
      line, sizeof line, "%s (%s tokens): %s train / %s validation tokens; unigram entropy %.4f nats/token%s",
      name().c_str(), tokenizer_name().c_str(), thousands(train_tokens()).c_str(),
      thousands(validation_tokens()).c_str(), unigram(), note.empty() ? "" : (" (" + note + ")").c_str());
  return line;
}

Status TrainData::check_flags(const Args& args) {
  const bool tokens = args.has("tokens");
  if (args.has("vocab") != args.has("merges"))
    return invalid_argument(
        "flags '--vocab' and '--merges' go together (a GPT-2 BPE tokenizer needs both files)");
  if (args.has("tokenizer") && args.has("vocab"))
    return invalid_argument("flags '--tokenizer' and '--vocab'/'--merges' both name a tokenizer; give one");
  for (const char* text_flag : {"data", "val-data", "vocab"}) {
    if (tokens && args.has(text_flag)) {
      return invalid_argument(
          "flag '--" + std::string(text_flag) +
          "' is for text; with '--tokens' the data is token files (--val-tokens validates)");
    }
  }
  for (const char* token_flag : {"val-tokens", "token-dtype", "vocab-size"}) {
    if (!tokens && args.has(token_flag))
      return invalid_argument("flag '--" + std::string(token_flag) + "' needs '--tokens'");
  }
  if (auto t = args.get("token-dtype")) {
    auto dtype = parse_token_dtype(*t);
    if (!dtype.ok()) return dtype.status().with_context("flag '--token-dtype'");
  }
  std::int64_t vocab = 1;
  return int_flag(args, "vocab-size", 1, (1ll << 31) - 1, &vocab);
}

Result<std::unique_ptr<TrainData>> TrainData::load(const Args& args, const TrainDataShape& shape) {
  if (args.has("tokens")) return TokenData::load(args, shape);
  return TextData::load(args, shape);
}

}  // namespace strata::cli
