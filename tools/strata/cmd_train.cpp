// strata train: trains a built-in GPT (GPT-2 or LLaMA style) on the built-in corpus or a text
// file, on one device without offload, with a live progress line, periodic validation and a
// summary that compares the loss with the unigram baseline of the data.
//
// Precedence of settings: the defaults below < a DeepSpeed-style --config file < flags.
// Exit codes: 0 trained, 1 a file could not be read/written or training failed, 2 bad flags.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"
#include "strata/config.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// The default run: sized by measurement to finish in about two minutes on two cores (see
// docs/training.md) with the validation loss far below the corpus's unigram entropy.
struct Defaults {
  static constexpr std::int64_t kLayers = 4;
  static constexpr std::int64_t kHeads = 4;
  static constexpr std::int64_t kWidth = 256;
  static constexpr std::int64_t kSeqLen = 128;
  static constexpr std::int64_t kBatch = 8;
  static constexpr std::int64_t kSteps = 600;
  static constexpr double kLr = 3e-3;
  static constexpr double kMinLrRatio = 0.1;
  static constexpr double kWeightDecay = 0.1;
  static constexpr double kGradClip = 1.0;
  static constexpr std::int64_t kValWindows = 64;
  static constexpr std::uint64_t kSeed = 1234;
};

// The default swap directory of the NVMe tier: fresh under $TMPDIR, removed when the run ends.
class TempSwapDir {
 public:
  static Result<std::unique_ptr<TempSwapDir>> create() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/strata-swap-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return io_error("cannot create a swap directory '" + tmpl + "' (set --nvme-path): " + std::strerror(errno));
    }
    return std::unique_ptr<TempSwapDir>(new TempSwapDir(tmpl));
  }
  ~TempSwapDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  explicit TempSwapDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

constexpr FlagSpec kTrainFlags[] = {
    {"config", "FILE", "DeepSpeed-style JSON: optimizer, scheduler, gradient_clipping, bf16, batch sizes"},
    {"steps", "N", "optimizer steps (default 600, or the config's scheduler total_num_steps)"},
    {"batch", "N", "sequences per micro-batch (default 8)"},
    {"grad-accum", "N", "micro-batches per step (default 1)"},
    {"seq-len", "T", "tokens per sequence (default 128)"},
    {"lr", "X", "peak learning rate (default 3e-3)"},
    {"warmup", "N", "learning-rate warmup steps (default 5% of --steps)"},
    {"min-lr-ratio", "X",
     "learning rate at the end of the cosine decay, as a fraction of --lr (default 0.1)"},
    {"weight-decay", "X", "AdamW weight decay of the weight matrices (default 0.1)"},
    {"grad-clip", "X", "clip the global gradient norm to X; 0 = off (default 1.0)"},
    {"seed", "N", "parameter initialisation and batch order (default 1234)"},
    {"data", "FILE", "train on a text file (split 90/10 at a line boundary) instead of the built-in corpus"},
    {"val-data", "FILE", "validate on this text file instead of the split"},
    {"vocab", "FILE", "GPT-2 BPE vocab.json (with --merges); default: byte tokens"},
    {"merges", "FILE", "GPT-2 BPE merges.txt (with --vocab)"},
    {"val-every", "K", "validate every K steps (default --steps/10; 0 = only at the end)"},
    {"val-windows", "N",
     "windows of seq-len+1 tokens per validation, from the start of the validation text "
     "(default 64; 0 = all)"},
    {"metrics", "FILE",
     "write one JSON object per step (step, loss, val_loss when computed, tokens_per_s, ...)"},
    {"save-weights", "FILE", "write the final weights as Hugging Face safetensors"},
    {"out", "DIR",
     "save the run: DIR/weights.safetensors (native layout, see strata export) and DIR/run.json"},
    {"offload-param", "TIER",
     "where working parameters live: none (device), cpu (host) or nvme (default nvme; a config's "
     "zero_optimization.offload_param wins over the default, this flag over both)"},
    {"offload-optimizer", "TIER",
     "where fp32 master weights and Adam moments live and the optimizer runs: none (device), cpu or "
     "nvme (default cpu)"},
    {"nvme-path", "DIR", "swap directory of the NVMe tier (default: a fresh directory under $TMPDIR, removed at exit)"},
    {"plan", "", "print the memory plan (bytes per tier) and exit"},
    {"quiet", "", "no progress line (the summary is still printed)"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kTrainFlags), std::end(kTrainFlags));
  f.insert(f.end(), std::begin(kModelFlags), std::end(kModelFlags));
  return f;
}

std::string train_usage() {
  const auto flags = all_flags();
  return "usage: strata train [flags]\n\n"
         "Trains a GPT with its state placed over device memory, host memory and NVMe. With no flags: a\n"
         "4-layer GPT-2 on the built-in corpus (byte tokens), cpu backend, parameters on NVMe, optimizer\n"
         "state on the host, activations and small modules on the device.\n\nflags:\n" +
         format_flags(flags);
}

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  }
  return buf;
}

std::string thousands(double v) {
  std::string digits = std::to_string(static_cast<long long>(std::llround(v)));
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

// Fails (exit 1) unless `path` can be created: its directory exists and is writable.
Status check_writable(const std::string& path, std::string_view what) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (!std::filesystem::is_directory(dir) || ::access(dir.c_str(), W_OK) != 0) {
    return io_error(std::string(what) + " '" + path + "' cannot be written: directory '" + dir.string() +
                    "' does not exist or is not writable");
  }
  return ok_status();
}

// The top-level keys a config file sets (so sections it leaves out keep our defaults).
std::vector<std::string> present_keys(const std::string& path) {
  std::vector<std::string> keys;
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, false, true);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  }
  return keys;
}

struct Data {
  std::unique_ptr<Tokenizer> tokenizer;
  std::string name;
  std::vector<std::int32_t> train, validation;
};

int fail(const Status& s) {
  std::fprintf(stderr, "strata train: %s\n", s.message().c_str());
  return kExitFailure;
}

int run_train(std::span<const std::string> argv) {
  use_passive_openmp_wait("train", argv);
  const auto flags = all_flags();
  auto parsed = Args::parse(argv, flags);
  if (!parsed.ok()) return usage_error("train", parsed.status().message(), train_usage());
  const Args& args = *parsed;
  if (args.has("help")) {
    std::fputs(train_usage().c_str(), stdout);
    return kExitOk;
  }
  if (!args.positionals().empty()) {
    return usage_error("train", "unexpected argument '" + args.positionals()[0] + "'", train_usage());
  }
  auto usage = [&](const Status& s) { return usage_error("train", s.message(), train_usage()); };

  // ---- settings: defaults < --config < flags ----
  TrainerConfig tc;
  tc.model.kind = ModelKind::kGpt2;
  tc.model.n_layer = Defaults::kLayers;
  tc.model.n_head = Defaults::kHeads;
  tc.model.n_embd = Defaults::kWidth;
  tc.micro_batch = Defaults::kBatch;
  tc.seq_len = Defaults::kSeqLen;
  tc.optimizer.beta2 = 0.95;
  tc.optimizer.weight_decay = Defaults::kWeightDecay;
  tc.schedule.kind = LrScheduleKind::kWarmupCosine;
  tc.schedule.lr = Defaults::kLr;
  tc.schedule.min_ratio = Defaults::kMinLrRatio;
  tc.grad_clip = Defaults::kGradClip;
  tc.seed = Defaults::kSeed;
  std::int64_t steps = Defaults::kSteps;
  bool schedule_from_config = false;
  Options options;
  OffloadSettings offload;
  offload.params = Tier::kNvme;
  offload.optimizer = Tier::kHost;
  if (auto path = args.get("config")) {
    auto config = load_config_file(*path, &options);
    if (!config.ok()) return fail(config.status());
    const auto keys = present_keys(*path);
    Status s = tc.apply(*config, keys);
    if (!s.ok()) return fail(s);
    if (std::find(keys.begin(), keys.end(), "zero_optimization") != keys.end() ||
        std::find(keys.begin(), keys.end(), "aio") != keys.end()) {
      s = offload.apply(*config);
      if (!s.ok()) return fail(s);
    }
    if (std::find(keys.begin(), keys.end(), "scheduler") != keys.end() &&
        config->scheduler.total_num_steps > 0) {
      steps = config->scheduler.total_num_steps;
      schedule_from_config = true;
    }
  }
  std::int64_t seed = static_cast<std::int64_t>(tc.seed);
  Status s = int_flag(args, "steps", 1, 1ll << 40, &steps);
  if (s.ok()) s = int_flag(args, "batch", 1, 1 << 20, &tc.micro_batch);
  if (s.ok()) s = int_flag(args, "grad-accum", 1, 1 << 20, &tc.grad_accum);
  if (s.ok()) s = int_flag(args, "seq-len", 1, 1 << 20, &tc.seq_len);
  if (s.ok()) s = int_flag(args, "seed", 0, std::numeric_limits<std::int64_t>::max(), &seed);
  if (s.ok()) s = double_flag(args, "weight-decay", 0.0, 1e3, &tc.optimizer.weight_decay);
  if (s.ok()) s = double_flag(args, "grad-clip", 0.0, 1e12, &tc.grad_clip);
  if (s.ok()) s = double_flag(args, "min-lr-ratio", 0.0, 1.0, &tc.schedule.min_ratio);
  if (s.ok() && args.has("lr")) {
    double lr = tc.schedule.lr;
    s = double_flag(args, "lr", 0.0, 10.0, &lr);
    tc.schedule.lr = lr;
    tc.optimizer.lr = lr;
    tc.schedule.warmup_max_lr = lr;
  }
  if (!schedule_from_config || args.has("steps")) tc.schedule.total_steps = steps;
  if (!schedule_from_config) tc.schedule.warmup_steps = std::max<std::int64_t>(1, steps / 20);
  if (s.ok()) s = int_flag(args, "warmup", 0, 1ll << 40, &tc.schedule.warmup_steps);
  if (s.ok()) s = apply_model_flags(args, tc.seq_len, &tc.model);
  if (!s.ok()) return usage(s);
  tc.seed = static_cast<std::uint64_t>(seed);
  std::int64_t val_every = std::max<std::int64_t>(1, steps / 10);
  std::int64_t val_windows = Defaults::kValWindows;
  s = int_flag(args, "val-every", 0, 1ll << 40, &val_every);
  if (s.ok()) s = int_flag(args, "val-windows", 0, 1ll << 40, &val_windows);
  if (s.ok() && args.has("vocab") != args.has("merges")) {
    s = invalid_argument(
        "flags '--vocab' and '--merges' go together (a GPT-2 BPE tokenizer needs both files)");
  }
  if (!s.ok()) return usage(s);

  // ---- files ----
  for (const char* flag : {"metrics", "save-weights"}) {
    if (auto p = args.get(flag)) {
      Status w = check_writable(*p, std::string("--") + flag + " file");
      if (!w.ok()) return fail(w);
    }
  }
  std::ofstream metrics;
  if (auto p = args.get("metrics")) {
    metrics.open(*p, std::ios::trunc);
    if (!metrics) return fail(io_error("--metrics file '" + *p + "' cannot be opened for writing"));
  }
  const std::string out_dir = args.get("out").value_or("");
  if (!out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec || ::access(out_dir.c_str(), W_OK) != 0) {
      return fail(io_error("--out directory '" + out_dir + "' cannot be created or written"));
    }
  }

  Data data;
  if (args.has("vocab")) {
    auto tok = load_bpe_tokenizer(*args.get("vocab"), *args.get("merges"));
    if (!tok.ok()) return fail(tok.status());
    data.tokenizer = std::move(*tok);
  } else {
    data.tokenizer = make_byte_tokenizer();
  }
  Corpus corpus;
  if (auto path = args.get("data")) {
    auto c = load_text_corpus(*path);
    if (!c.ok()) return fail(c.status());
    corpus = std::move(*c);
    data.name = *path;
  } else {
    corpus = builtin_corpus();
    data.name = "built-in corpus";
  }
  if (auto path = args.get("val-data")) {
    std::ifstream in(*path, std::ios::binary);
    if (!in) return fail(not_found("--val-data file '" + *path + "' cannot be opened"));
    std::stringstream ss;
    ss << in.rdbuf();
    corpus.validation = ss.str();
  }
  data.train = data.tokenizer->encode(corpus.train);
  data.validation = data.tokenizer->encode(corpus.validation);
  tc.model.vocab_size = data.tokenizer->vocab_size();
  const double unigram = unigram_entropy(data.train, data.tokenizer->vocab_size());
  auto batcher = Batcher::create(data.train, tc.micro_batch, tc.seq_len, tc.seed);
  if (!batcher.ok()) return fail(batcher.status().with_context("training data (" + data.name + ")"));
  const bool can_validate = static_cast<std::int64_t>(data.validation.size()) > tc.seq_len;
  s = tc.validate();
  if (!s.ok()) return usage(s);

  // ---- placement, plan, device and engine ----
  for (const auto& [flag, tier] : {std::pair{"offload-param", &offload.params}, std::pair{"offload-optimizer", &offload.optimizer}}) {
    if (auto v = args.get(flag)) {
      auto t = parse_tier(*v);
      if (!t.ok()) return usage(invalid_argument("flag '--" + std::string(flag) + "': " + t.status().message()));
      *tier = *t;
    }
  }
  std::unique_ptr<TempSwapDir> temp_swap;
  if (auto dir = args.get("nvme-path")) {
    offload.nvme_path = {*dir};
    offload.io.nvme_path = offload.nvme_path;
  }
  const bool uses_nvme = offload.params == Tier::kNvme || offload.optimizer == Tier::kNvme;
  if (uses_nvme && offload.nvme_path.empty()) {
    auto t = TempSwapDir::create();
    if (!t.ok()) return fail(t.status());
    temp_swap = std::move(*t);
    offload.nvme_path = {temp_swap->path()};
    offload.io.nvme_path = offload.nvme_path;
  }
  s = offload.validate();
  if (!s.ok()) return usage(s);
  auto plan = OffloadPlan::make(tc, offload);
  if (!plan.ok()) return usage(plan.status());
  if (args.has("plan")) {
    std::printf("%s", plan->to_string().c_str());
    return kExitOk;
  }
  DeviceConfig dc;
  s = device_options(args, plan->device_bytes, &options, &dc);
  if (!s.ok()) return s.code() == StatusCode::kInvalidArgument ? usage(s) : fail(s);
  tc.optimizer_isa = options.get_string(Option::kAdamIsa);
  if (plan->pinned_bytes + (64u << 20) > dc.pinned_bytes && options.source(Option::kPinnedMemory) == "default") {
    dc.pinned_bytes = align_up(plan->pinned_bytes + (64u << 20), 1u << 20);
  }
  auto device = Device::create(dc);
  // A device this machine or build does not have (cuda without a GPU) is a wrong request, like
  // a bad flag: exit 2, as bench step does, not a run that failed.
  if (!device.ok() && device.status().code() == StatusCode::kUnavailable) {
    return usage_error("train", "--device " + std::string(to_string(dc.kind)) + ": " + device.status().message(),
                       train_usage());
  }
  if (!device.ok()) return fail(device.status());
  auto engine = OffloadEngine::create(tc, offload, **device);
  if (!engine.ok()) return fail(engine.status());
  OffloadEngine& tr = **engine;

  const ModelLayout& layout = tr.model().layout();
  const std::int64_t tokens_per_step = tc.micro_batch * tc.grad_accum * tc.seq_len;
  std::printf(
      "model    %s: %lld layers, width %lld, %lld heads, context %lld, vocab %lld, %s%s; %.2fM parameters\n",
      std::string(to_string(tc.model.kind)).c_str(), static_cast<long long>(tc.model.n_layer),
      static_cast<long long>(tc.model.n_embd), static_cast<long long>(tc.model.n_head),
      static_cast<long long>(tc.model.n_positions), static_cast<long long>(tc.model.vocab_size),
      std::string(to_string(tc.model.dtype)).c_str(),
      tc.model.activation_checkpointing ? ", activation checkpointing" : "",
      static_cast<double>(layout.num_parameters()) / 1e6);
  std::printf("data     %s (%s tokens): %s train / %s validation tokens; unigram entropy %.4f nats/token\n",
              data.name.c_str(), data.tokenizer->name().c_str(),
              thousands(static_cast<double>(data.train.size())).c_str(),
              thousands(static_cast<double>(data.validation.size())).c_str(), unigram);
  std::printf(
      "train    %lld steps x %lld tokens (batch %lld x accum %lld x seq %lld), %s, lr %g (warmup %lld, "
      "cosine "
      "to %g), weight decay %g, clip %g\n",
      static_cast<long long>(steps), static_cast<long long>(tokens_per_step),
      static_cast<long long>(tc.micro_batch), static_cast<long long>(tc.grad_accum),
      static_cast<long long>(tc.seq_len), tr.optimizer_name().c_str(), tc.schedule.lr,
      static_cast<long long>(tc.schedule.warmup_steps), tc.schedule.lr * tc.schedule.min_ratio,
      tc.optimizer.weight_decay, tc.grad_clip);
  std::printf("device   %s, %d compute threads, %s budget\n", (*device)->info().name.c_str(),
              (*device)->info().compute_threads, format_bytes((*device)->info().memory_budget).c_str());
  std::printf("offload  parameters on %s, optimizer state on %s%s%s\n%s", std::string(to_string(offload.params)).c_str(),
              std::string(to_string(offload.optimizer)).c_str(), uses_nvme ? ", swap in " : "",
              uses_nvme ? offload.nvme_path.front().c_str() : "", tr.plan().to_string().c_str());
  std::fflush(stdout);

  // ---- the loop ----
  const bool live = !args.has("quiet") && ::isatty(STDOUT_FILENO) == 1;
  const bool quiet = args.has("quiet");
  const std::int64_t log_every = std::max<std::int64_t>(1, steps / 20);
  std::vector<std::int32_t> inputs, targets, mb_in, mb_tg;
  const auto start = Clock::now();
  double train_seconds = 0, recent_seconds = 0, recent_tokens = 0;
  std::vector<double> recent_losses;
  double last_val = std::nan("");
  std::int64_t val_tokens = 0;
  auto validate = [&]() -> Status {
    auto r = tr.evaluate(data.validation, val_windows);
    if (!r.ok()) return r.status();
    last_val = r->loss;
    val_tokens = r->tokens;
    return ok_status();
  };
  for (std::int64_t step = 0; step < steps; ++step) {
    inputs.clear();
    targets.clear();
    for (std::int64_t a = 0; a < tc.grad_accum; ++a) {
      batcher->batch(static_cast<std::uint64_t>(step * tc.grad_accum + a), mb_in, mb_tg);
      inputs.insert(inputs.end(), mb_in.begin(), mb_in.end());
      targets.insert(targets.end(), mb_tg.begin(), mb_tg.end());
    }
    auto m = tr.step(inputs, targets);
    if (!m.ok()) {
      if (live) std::printf("\n");
      return fail(m.status().with_context("step " + std::to_string(step + 1)));
    }
    train_seconds += m->seconds;
    recent_seconds = 0.8 * recent_seconds + 0.2 * m->seconds;
    recent_tokens = 0.8 * recent_tokens + 0.2 * static_cast<double>(m->tokens);
    if (step == 0) {
      recent_seconds = m->seconds;
      recent_tokens = static_cast<double>(m->tokens);
    }
    recent_losses.push_back(m->loss);
    const bool last = step + 1 == steps;
    const bool do_val = can_validate && (last || (val_every > 0 && (step + 1) % val_every == 0));
    if (do_val) {
      Status v = validate();
      if (!v.ok()) return fail(v.with_context("validation"));
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(steps - step - 1);
    const double tok_s = recent_tokens / std::max(recent_seconds, 1e-9);
    if (metrics.is_open()) {
      Json j;
      j["step"] = m->step;
      j["loss"] = m->loss;
      if (do_val) j["val_loss"] = last_val;
      j["lr"] = m->lr;
      j["grad_norm"] = m->grad_norm;
      j["tokens"] = m->tokens;
      j["tokens_per_s"] = static_cast<double>(m->tokens) / std::max(m->seconds, 1e-9);
      j["elapsed_s"] = elapsed;
      metrics << j.dump() << '\n';
      metrics.flush();
    }
    char line[256];
    std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %s tok/s | %s elapsed | ETA %s",
                  static_cast<long long>(step + 1), static_cast<long long>(steps), m->loss, m->lr,
                  thousands(tok_s).c_str(), clock_text(elapsed).c_str(), clock_text(eta).c_str());
    if (live) {
      std::printf("\r\033[K%s", line);
      if (do_val)
        std::printf("\n  validation loss %.4f (%lld tokens)\n", last_val, static_cast<long long>(val_tokens));
      std::fflush(stdout);
    } else if (!quiet && (step == 0 || last || (step + 1) % log_every == 0 || do_val)) {
      std::printf("%s", line);
      if (do_val) std::printf(" | val loss %.4f", last_val);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (live) std::printf("\n");
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();

  // ---- outputs ----
  if (auto p = args.get("save-weights")) {
    Status w = tr.save_weights(*p, WeightFormat::kHuggingFace);
    if (!w.ok()) return fail(w);
  }
  const std::size_t tail = std::min<std::size_t>(recent_losses.size(), 10);
  double train_loss = 0;
  for (std::size_t i = recent_losses.size() - tail; i < recent_losses.size(); ++i)
    train_loss += recent_losses[i] / tail;
  Json summary;
  summary["steps"] = steps;
  summary["train_loss"] = train_loss;
  summary["final_step_loss"] = recent_losses.back();
  if (can_validate) {
    summary["val_loss"] = last_val;
    summary["val_tokens"] = val_tokens;
  }
  summary["unigram_entropy"] = unigram;
  summary["wall_s"] = wall;
  summary["tokens_per_s"] = static_cast<double>(tokens_per_step * steps) / train_seconds;
  summary["parameters"] = layout.num_parameters();
  {
    const OffloadStats os = tr.stats();
    summary["offload_param"] = std::string(to_string(offload.params));
    summary["offload_optimizer"] = std::string(to_string(offload.optimizer));
    summary["bytes_h2d"] = os.bytes_h2d;
    summary["bytes_d2h"] = os.bytes_d2h;
    summary["bytes_nvme_read"] = os.bytes_nvme_read;
    summary["bytes_nvme_written"] = os.bytes_nvme_written;
    summary["prefetch_hit_rate"] = os.hit_rate();
    summary["allocations_after_warmup"] = os.allocations_after_warmup;
  }
  if (!out_dir.empty()) {
    const std::string weights = (std::filesystem::path(out_dir) / "weights.safetensors").string();
    Status w = tr.save_weights(weights, WeightFormat::kNative);
    if (!w.ok()) return fail(w);
    Json run;
    run["model"] = Json::parse(model_config_to_json(tc.model));
    run["micro_batch"] = tc.micro_batch;
    run["grad_accum"] = tc.grad_accum;
    run["seq_len"] = tc.seq_len;
    run["seed"] = tc.seed;
    run["data"] = data.name;
    run["tokenizer"] = data.tokenizer->name();
    run["summary"] = summary;
    const std::string run_path = (std::filesystem::path(out_dir) / "run.json").string();
    std::ofstream out(run_path, std::ios::trunc);
    out << run.dump(2) << '\n';
    if (!out) return fail(io_error("cannot write '" + run_path + "'"));
  }

  std::printf("\ndone: %lld steps in %s (%s tokens/s)\n", static_cast<long long>(steps),
              clock_text(wall).c_str(), thousands(summary["tokens_per_s"].get<double>()).c_str());
  std::printf("  train loss       %.4f nats/token (mean of the last %zu steps)\n", train_loss, tail);
  if (can_validate) {
    std::printf("  validation loss  %.4f nats/token (%lld tokens)\n", last_val,
                static_cast<long long>(val_tokens));
  }
  std::printf("  unigram baseline %.4f nats/token (a model that knows only token frequencies)\n", unigram);
  {
    const OffloadStats os = tr.stats();
    std::printf("  traffic          host->device %s, device->host %s, NVMe read %s, NVMe written %s\n",
                format_bytes(os.bytes_h2d).c_str(), format_bytes(os.bytes_d2h).c_str(),
                format_bytes(os.bytes_nvme_read).c_str(), format_bytes(os.bytes_nvme_written).c_str());
    std::printf("  prefetch         %.1f%% of %llu parameter fetches issued ahead; %llu allocations after the "
                "first step; host optimizer %.1f s CPU\n",
                100.0 * os.hit_rate(), static_cast<unsigned long long>(os.param_accesses),
                static_cast<unsigned long long>(os.allocations_after_warmup), os.optimizer_cpu_seconds);
  }
  if (can_validate) {
    std::printf("  validation loss is %.2f x the unigram baseline\n", last_val / unigram);
  }
  if (auto p = args.get("save-weights"))
    std::printf("  weights (Hugging Face safetensors): %s\n", p->c_str());
  if (!out_dir.empty())
    std::printf("  run saved in %s (strata export --run %s --weights OUT)\n", out_dir.c_str(),
                out_dir.c_str());
  return kExitOk;
}

}  // namespace

STRATA_CLI_COMMAND(train,
                   "train a GPT (built-in corpus by default) and report loss against the unigram baseline",
                   run_train);

}  // namespace strata::cli
