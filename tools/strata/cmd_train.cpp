// strata train: trains a built-in GPT (GPT-2 or LLaMA style) on the built-in corpus or a text
// file, its state placed over device memory, host memory and NVMe by the offload engine, with a
// live progress line, periodic validation, atomic checkpoints of every tier (--checkpoint-dir,
// --resume) and a summary that compares the loss with the unigram baseline of the data.
//
// Precedence of settings: the defaults below < a DeepSpeed-style --config file < flags.
// Exit codes: 0 trained, 1 a file could not be read/written or training failed, 2 bad flags,
// 128 + N stopped by signal N (SIGTERM, SIGINT): the step in progress finishes, a checkpoint is
// saved when --checkpoint-dir is set (resume with --resume), the run's files are written, and the
// process exits; a second signal ends it at once. Under mpirun the ranks agree on the step to
// stop after (the flag is all-reduced each step), so the checkpoint is collective as usual.
//
// Data parallel: started by `mpirun -np N strata train ...`, every rank trains its share of each
// step's batch (global micro-batch i of a step goes to rank i mod N, so N ranks with --grad-accum
// A see the batches of one process with A x N) through the engine's data-parallel group
// (docs/parallel.md). Rank 0 prints, validates and writes the run's files; every rank takes part
// in checkpoints, weights and validation (a pipeline's stages send their state to rank 0, which
// writes the single process's files); errors name the rank.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"
#include "settings.hpp"
#include "strata/checkpoint.hpp"
#include "strata/config.hpp"
#include "strata/data.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/nvme.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"
#include "strata/parallel.hpp"

namespace strata::cli {
namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// Validation windows per evaluation (the other defaults are in settings.hpp).
constexpr std::int64_t kValWindows = 64;

// The default swap directory of the NVMe tier: fresh under $TMPDIR, removed when the run ends; its
// swap files are scratch (unlinked once open), so a killed run does not leave them behind.
class TempSwapDir {
 public:
  static Result<std::unique_ptr<TempSwapDir>> create() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/strata-swap-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return io_error("cannot create a swap directory '" + tmpl +
                      "' (set --nvme-path): " + std::strerror(errno));
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
    {"data", "FILE", "train on a text file (split 90/10 at a line boundary) instead of the built-in corpus"},
    {"val-data", "FILE", "validate on this text file instead of the split"},
    {"vocab", "FILE", "GPT-2 BPE vocab.json (with --merges); default: byte tokens"},
    {"merges", "FILE", "GPT-2 BPE merges.txt (with --vocab)"},
    {"val-every", "K", "validate every K steps (default --steps/10; 0 = only at the end)"},
    {"val-windows", "N",
     "windows of seq-len+1 tokens per validation, from the start of the validation text "
     "(default 64; 0 = all)"},
    {"metrics", "FILE",
     "write one JSON object per step: loss, val_loss when computed, lr, grad norm, step time and its "
     "breakdown per engine, bytes per tier, traffic per link (docs/observability.md; default "
     "DIR/metrics.jsonl with --out)"},
    {"trace", "FILE", "write a Chrome/Perfetto trace of the run (open it in ui.perfetto.dev)"},
    {"save-weights", "FILE", "write the final weights as Hugging Face safetensors"},
    {"out", "DIR",
     "save the run: DIR/weights.safetensors (native layout, see strata export), DIR/run.json and "
     "DIR/metrics.jsonl (strata report DIR draws them)"},
    {"checkpoint-dir", "DIR",
     "save the complete training state (every tier) under DIR at the end and every --checkpoint-every "
     "steps; atomic: DIR/latest names the newest complete checkpoint"},
    {"checkpoint-every", "K", "save a checkpoint every K steps (default 0: only at the end)"},
    {"keep-checkpoints", "N", "checkpoints kept under --checkpoint-dir (default 2)"},
    {"resume", "PATH",
     "continue from a checkpoint (a checkpoint directory, or a --checkpoint-dir: its latest) up to --steps; "
     "the same model, data, batch shape and seed are required, the placement may differ"},
    {"plan", "",
     "print the memory plan (bytes per tier) and exit; under mpirun each rank's (ZeRO shards its state), "
     "with a "
     "pipeline every stage's"},
    {"quiet", "", "no progress line (the summary is still printed)"},
    {"help", "", "show this help"},
};

std::vector<FlagSpec> all_flags() {
  std::vector<FlagSpec> f(std::begin(kSettingsFlags), std::end(kSettingsFlags));
  f.insert(f.end(), std::begin(kTrainFlags), std::end(kTrainFlags));
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

// One step's record for the metrics file: the step's numbers, where its time went (OffloadStats
// deltas over the step() call), the plan's bytes per tier and the traffic per link.
Json step_record(const StepMetrics& m, const OffloadStats& before, const OffloadStats& after,
                 const OffloadPlan& plan) {
  Json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lr"] = m.lr;
  if (std::isfinite(m.grad_norm)) j["grad_norm"] = m.grad_norm;  // an overflowed fp16 step has none
  j["tokens"] = m.tokens;
  j["tokens_per_s"] = static_cast<double>(m.tokens) / std::max(m.seconds, 1e-9);
  j["step_s"] = m.seconds;
  Json t;
  if (after.stream_times) {
    t["compute"] = after.compute_seconds - before.compute_seconds;
    t["fetch_stall"] = after.fetch_stall_seconds - before.fetch_stall_seconds;
    t["h2d"] = after.h2d_seconds - before.h2d_seconds;
    t["d2h"] = after.d2h_seconds - before.d2h_seconds;
  }
  t["nvme_read"] = after.nvme_read_seconds - before.nvme_read_seconds;
  t["nvme_write"] = after.nvme_write_seconds - before.nvme_write_seconds;
  t["optimizer"] = after.optimizer_seconds - before.optimizer_seconds;
  t["optimizer_cpu"] = after.optimizer_cpu_seconds - before.optimizer_cpu_seconds;
  t["compute_cpu"] = after.compute_cpu_seconds - before.compute_cpu_seconds;
  t["copy_cpu"] = after.copy_cpu_seconds - before.copy_cpu_seconds;
  t["io_cpu"] = after.io_cpu_seconds - before.io_cpu_seconds;
  t["update_stall"] = after.update_stall_seconds - before.update_stall_seconds;
  t["data_parallel"] = after.dp_seconds - before.dp_seconds;
  j["time_s"] = t;
  // The plan's bytes: allocated up front, so constant over the run.
  j["bytes"] = Json{{"device", plan.device_bytes},
                    {"host", plan.host_bytes},
                    {"pinned", plan.pinned_bytes},
                    {"nvme", plan.nvme_bytes}};
  j["traffic"] =
      Json{{"h2d", after.bytes_h2d - before.bytes_h2d},
           {"d2h", after.bytes_d2h - before.bytes_d2h},
           {"nvme_read", after.bytes_nvme_read - before.bytes_nvme_read},
           {"nvme_write", after.bytes_nvme_written - before.bytes_nvme_written},
           {"data_parallel", after.bytes_dp - before.bytes_dp},
           // The model's collectives on the tensor-parallel group (StepPrediction::tp_bytes).
           {"tensor_parallel", after.bytes_tp - before.bytes_tp},
           // This rank's boundary tensors sent to its pipeline neighbours (with sequence
           // parallelism its rows of them: 1/tp of the bytes without it).
           {"pipeline", after.bytes_pp - before.bytes_pp},
           {"activations", (after.bytes_activations_to_host - before.bytes_activations_to_host) +
                               (after.bytes_activations_to_device - before.bytes_activations_to_device)}};
  j["prefetch_hits"] = after.prefetch_hits - before.prefetch_hits;
  j["early_fetch_hits"] = after.early_fetch_hits - before.early_fetch_hits;
  j["param_accesses"] = after.param_accesses - before.param_accesses;
  j["early_optimizer_reads"] = after.early_optimizer_reads - before.early_optimizer_reads;
  return j;
}

Status write_json_file(const std::string& path, const Json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << '\n';
  out.flush();
  if (!out) return io_error("cannot write '" + path + "'");
  return ok_status();
}

struct Data {
  std::unique_ptr<Tokenizer> tokenizer;
  std::string name;
  std::vector<std::int32_t> train, validation;
};

// "rank R: " under mpirun with several ranks (errors go to stderr from every rank).
std::string g_rank_prefix;

// The signal that asked the run to stop (0: none). The first SIGTERM/SIGINT sets it and restores
// the default action, so a second one ends the process at once.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void request_stop(int sig) {
  g_stop_signal = sig;
  std::signal(sig, SIG_DFL);
}

int fail(const Status& s) {
  std::fprintf(stderr, "strata train: %s%s\n", g_rank_prefix.c_str(), s.message().c_str());
  return kExitFailure;
}

int usage(const Status& s) { return usage_error("train", s.message(), train_usage()); }

// Each phase of the command below either lets the run go on (nullopt) or ends it with this exit
// code.
using Exit = std::optional<int>;

// The trace is written however the run ends: a failed step is when it is most wanted.
struct TraceWriter {
  OffloadEngine& engine;
  std::string path;
  Status write() {
    if (path.empty()) return ok_status();
    Status s = engine.write_trace(path);
    path.clear();
    return s;
  }
  ~TraceWriter() {
    Status s = write();
    if (!s.ok()) std::fprintf(stderr, "strata train: %s\n", s.message().c_str());
  }
};

// What the loop leaves for the summary.
struct Progress {
  int stop_signal = 0;
  std::int64_t end_step = 0;  // the step the run stopped after
  double train_seconds = 0;
  std::vector<double> losses;  // each step's, from the first one this process ran
  double last_val = std::nan("");
  std::int64_t val_tokens = 0;
  std::int64_t skipped_steps = 0;  // fp16: steps whose gradients overflowed
  double last_scale = 1.0;
  double wall = 0;
};

// Everything one `strata train` holds, in the order the phases build it. Members are destroyed
// in reverse: the trace is written while the engine exists, and the engine goes before the
// communicators and the device it uses.
struct TrainRun {
  explicit TrainRun(const Args& a) : args(a) {}
  const Args& args;

  // ---- settings: defaults < --config < flags (settings.hpp) ----
  RunSettings rs;
  TrainerConfig& tc = rs.trainer;
  OffloadSettings& offload = rs.offload;
  Options& options = rs.options;
  std::int64_t steps = 0;

  // ---- ranks and their groups ----
  std::unique_ptr<CommContext> comm_context;  // under mpirun
  int rank = 0, ranks = 1;
  int tp_size = 1;
  Options pp_options;  // the config's tunables, then the environment's
  std::int64_t pp = 1;
  bool leader = true;
  std::optional<ProcessGroups> groups;
  int dp_size = 1, dp_rank = 0;

  // ---- the run's own flags and files ----
  std::int64_t val_every = 1;
  std::int64_t val_windows = kValWindows;
  std::int64_t checkpoint_every = 0, keep_checkpoints = 2;
  std::string checkpoint_dir;
  std::string out_dir;  // rank 0's --out
  std::ofstream metrics;
  std::string metrics_path;

  // ---- data ----
  Data data;
  std::optional<Batcher> batcher;
  double unigram = 0;
  bool can_validate = false;

  // ---- placement, device, engine ----
  std::unique_ptr<TempSwapDir> temp_swap;
  bool uses_nvme = false;
  std::optional<OffloadPlan> plan;
  DeviceConfig dc;
  std::unique_ptr<Device> device;
  std::unique_ptr<Comm> dp_group, tp_group, pp_group;  // outlive the engine
  std::unique_ptr<OffloadEngine> engine;
  std::string trace_path;
  ObserveSettings observe;
  std::unique_ptr<TraceWriter> trace_writer;

  // ---- checkpoints, run.json, the loop ----
  Json identity;  // what a checkpoint must agree on to be resumed
  std::int64_t first_step = 0;
  Json run;
  std::string run_path;
  Progress progress;

  OffloadEngine& tr() { return *engine; }
  std::int64_t tokens_per_step() const { return tc.micro_batch * tc.grad_accum * tc.seq_len * dp_size; }
};

Exit resolve_settings(TrainRun& r) {
  if (Status c = load_settings(r.args, r.args.get("config").value_or(""), &r.rs); !c.ok()) return fail(c);
  if (Status f = apply_settings_flags(r.args, &r.rs); !f.ok()) return usage(f);
  r.steps = r.rs.steps;
  if (r.rs.config) {
    for (const AutoValue& a : auto_resolution(r.rs, r.args)) std::printf("config   %s\n", a.line().c_str());
    for (const IgnoredKey& k : r.rs.config->ignored)
      std::printf("config   ignored %s: %s\n", k.path.c_str(), k.reason.c_str());
  }
  return std::nullopt;
}

// Data parallel: one rank per process under mpirun. Tensor parallel: each group of tp_size
// consecutive ranks splits one model; the groups are the data-parallel ranks
// (make_process_groups' grid, docs/parallel.md).
Exit start_ranks(TrainRun& r) {
  {
    Options tp_options = r.options;
    if (Status e = tp_options.load_env(); !e.ok()) return usage(e);
    r.tp_size = static_cast<int>(tp_options.get_int(Option::kTensorParallelSize));
  }
  if (launched_by_mpirun()) {
    Options comm_options = r.options;  // the config's tunables, then the environment's (as the device's)
    if (Status e = comm_options.load_env(); !e.ok()) return usage(e);
    auto cc = CommConfig::from_options(comm_options);
    if (!cc.ok()) return usage(cc.status());
    auto ctx = CommContext::create(*cc);
    if (!ctx.ok()) return fail(ctx.status().with_context("data parallel under mpirun"));
    r.comm_context = std::move(*ctx);
    r.rank = r.comm_context->world_rank();
    r.ranks = r.comm_context->world_size();
  }
  return std::nullopt;
}

// Pipeline parallel: strata.pipeline_parallel_size stages, one per process.
Exit read_pipeline_settings(TrainRun& r) {
  r.pp_options = r.options;
  if (Status e = r.pp_options.load_env(); !e.ok()) return usage(e);
  const Options& o = r.pp_options;
  const std::int64_t pp = o.get_int(Option::kPipelineParallelSize);
  r.pp = pp;
  const std::string key = o.source(Option::kPipelineParallelSize);
  if (pp < 1) {
    return usage(
        invalid_argument(key + ": pipeline_parallel_size = " + std::to_string(pp) + " must be at least 1"));
  }
  if (pp > 1 && r.ranks % pp != 0) {
    return usage(invalid_argument(key + ": pipeline_parallel_size = " + std::to_string(pp) + " with " +
                                  std::to_string(r.ranks) +
                                  " process(es): every stage is a process of its own, so the number of "
                                  "processes must be a multiple of it "
                                  "(pipelines x stages); start `mpirun -np " +
                                  std::to_string(pp) + " strata train ...` or a multiple"));
  }
  auto schedule = parse_pipeline_schedule(o.get_string(Option::kPipelineSchedule));
  if (!schedule.ok()) {
    return usage(invalid_argument(o.source(Option::kPipelineSchedule) + ": " + schedule.status().message()));
  }
  r.offload.pipeline_schedule = *schedule;
  // Interleaved 1F1B: the engine refuses what it does not run (a gpipe schedule, micro-batches
  // not a multiple of the stages, more chunks than modules, ...), naming the key.
  const std::int64_t v = o.get_int(Option::kPipelineVirtualStages);
  if (v < 1 || (v > 1 && pp < 2)) {
    return usage(invalid_argument(
        o.source(Option::kPipelineVirtualStages) + ": pipeline_virtual_stages = " + std::to_string(v) +
        (v < 1 ? " must be at least 1"
               : " interleaves the chunks of a pipeline and needs pipeline_parallel_size > 1")));
  }
  r.offload.pipeline_virtual_stages = static_cast<int>(v);
  return std::nullopt;
}

// The rank grid (parallel.hpp: rank = (dp * PP + stage) * TP + tp), DP = ranks / (TP * PP): the
// data-parallel ranks (model replicas: pipelines, each stage of which may be a tensor-parallel
// group) and this process's index among them.
Exit make_groups(TrainRun& r) {
  r.leader = r.rank == 0;
  const int tp_size = r.tp_size;
  const std::int64_t pp = r.pp;
  if (tp_size < 1 || r.ranks % (tp_size * pp) != 0) {
    const std::string launch =
        launched_by_mpirun() ? ", mpirun -np" : ": one process; launch with mpirun -np N";
    if (tp_size > 1 && pp > 1) {
      return usage(invalid_argument(
          "strata.tensor_parallel_size = " + std::to_string(tp_size) +
          " times strata.pipeline_parallel_size = " + std::to_string(pp) +
          " must divide the number of ranks (" + std::to_string(r.ranks) + launch +
          "): every pipeline stage is a group of that many tensor-parallel ranks; start `mpirun -np " +
          std::to_string(tp_size * pp) + " strata train ...` or a multiple"));
    }
    return usage(invalid_argument(
        "strata.tensor_parallel_size = " + std::to_string(tp_size) +
        " must be at least 1 and divide the number of ranks (" + std::to_string(r.ranks) + launch +
        (pp > 1 ? " over pipeline_parallel_size = " + std::to_string(pp) : std::string()) +
        "): each model is split over that many ranks"));
  }
  if (tp_size > 1 || pp > 1) {
    auto g = make_process_groups(*r.comm_context, CommBackend::kMpi, tp_size, static_cast<int>(pp));
    if (!g.ok()) {
      return fail(g.status().with_context(tp_size > 1 && pp > 1
                                              ? "tensor-, pipeline- and data-parallel groups"
                                          : pp > 1 ? "pipeline groups"
                                                   : "tensor- and data-parallel groups"));
    }
    r.groups = std::move(*g);
  }
  r.dp_size = r.groups ? r.groups->grid.dp() : r.ranks;
  r.dp_rank = r.groups ? r.groups->coord.dp : r.rank;
  if (r.ranks > 1) {
    g_rank_prefix = "rank " + std::to_string(r.rank) + ": ";
    // One rank speaks: the others' output would repeat it.
    if (!r.leader && std::freopen("/dev/null", "w", stdout) == nullptr)
      return fail(io_error("cannot silence stdout"));
  }
  return std::nullopt;
}

Exit read_run_flags(TrainRun& r) {
  const Args& args = r.args;
  r.val_every = std::max<std::int64_t>(1, r.steps / 10);
  Status s = int_flag(args, "val-every", 0, 1ll << 40, &r.val_every);
  if (s.ok()) s = int_flag(args, "val-windows", 0, 1ll << 40, &r.val_windows);
  if (s.ok()) s = int_flag(args, "checkpoint-every", 0, 1ll << 40, &r.checkpoint_every);
  if (s.ok()) s = int_flag(args, "keep-checkpoints", 1, 1 << 20, &r.keep_checkpoints);
  r.checkpoint_dir = args.get("checkpoint-dir").value_or("");
  if (s.ok() && r.checkpoint_dir.empty() && (args.has("checkpoint-every") || args.has("keep-checkpoints"))) {
    s = invalid_argument("flags '--checkpoint-every' and '--keep-checkpoints' need '--checkpoint-dir'");
  }
  if (s.ok() && args.has("vocab") != args.has("merges")) {
    s = invalid_argument(
        "flags '--vocab' and '--merges' go together (a GPT-2 BPE tokenizer needs both files)");
  }
  if (!s.ok()) return usage(s);
  return std::nullopt;
}

// The run directory first: --metrics or --trace may point into it. The run's files are rank 0's
// (the others have the same losses and weights).
Exit open_run_files(TrainRun& r) {
  const Args& args = r.args;
  r.out_dir = r.leader ? args.get("out").value_or("") : "";
  if (!r.out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(r.out_dir, ec);
    if (ec || ::access(r.out_dir.c_str(), W_OK) != 0) {
      return fail(io_error("--out directory '" + r.out_dir + "' cannot be created or written"));
    }
  }
  for (const char* flag : {"metrics", "save-weights", "trace"}) {
    if (!r.leader) break;
    if (auto p = args.get(flag)) {
      Status w = check_writable(*p, std::string("--") + flag + " file");
      if (!w.ok()) return fail(w);
    }
  }
  r.metrics_path = r.leader ? args.get("metrics").value_or("") : "";
  if (r.metrics_path.empty() && !r.out_dir.empty()) {
    r.metrics_path = (std::filesystem::path(r.out_dir) / "metrics.jsonl").string();
  }
  if (!r.metrics_path.empty()) {
    // A resumed run continues the record of the run it resumes.
    r.metrics.open(r.metrics_path, args.has("resume") ? std::ios::app : std::ios::trunc);
    if (!r.metrics)
      return fail(io_error("--metrics file '" + r.metrics_path + "' cannot be opened for writing"));
  }
  return std::nullopt;
}

Exit load_data(TrainRun& r) {
  const Args& args = r.args;
  Data& data = r.data;
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
  r.tc.model.vocab_size = data.tokenizer->vocab_size();
  r.unigram = unigram_entropy(data.train, data.tokenizer->vocab_size());
  auto batcher = Batcher::create(data.train, r.tc.micro_batch, r.tc.seq_len, r.tc.seed);
  if (!batcher.ok()) return fail(batcher.status().with_context("training data (" + data.name + ")"));
  r.batcher.emplace(std::move(*batcher));
  r.can_validate = static_cast<std::int64_t>(data.validation.size()) > r.tc.seq_len;
  return std::nullopt;
}

// The model and its parallel layout, once the vocabulary is known.
Exit check_model(TrainRun& r) {
  Status s = r.tc.validate();
  if (!s.ok()) return usage(s);
  if (r.tp_size > 1) {
    // The model's heads, MLP width and vocabulary must split (the error names the field).
    s = check_tensor_parallel(r.tc.model, r.tp_size);
    if (!s.ok()) return usage(s);
  }
  r.offload.tp_size = r.tp_size;  // the plan (--plan and the printed one) is this rank's shard
  r.offload.sequence_parallel = r.pp_options.get_bool(Option::kSequenceParallel);
  if (r.offload.sequence_parallel && r.tp_size < 2) {
    return usage(
        invalid_argument(r.pp_options.source(Option::kSequenceParallel) +
                         ": sequence_parallel = true splits the tokens over the tensor-parallel group, but "
                         "strata.tensor_parallel_size = " +
                         std::to_string(r.tp_size) +
                         ": set tensor_parallel_size > 1 (under mpirun) or sequence_parallel false"));
  }
  return std::nullopt;
}

// The NVMe tier's swap directories: one of its own per rank under each --nvme-path, or a fresh
// scratch directory.
Exit prepare_swap(TrainRun& r) {
  OffloadSettings& offload = r.offload;
  r.uses_nvme = offload.params == Tier::kNvme || offload.optimizer == Tier::kNvme;
  if (r.uses_nvme && r.ranks > 1 && !offload.nvme_path.empty()) {
    // Every rank swaps its own state: a directory of its own under each path.
    for (std::string& dir : offload.nvme_path) {
      dir = (std::filesystem::path(dir) / ("rank-" + std::to_string(r.rank))).string();
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec)
        return fail(
            io_error("cannot create the swap directory '" + dir + "' (--nvme-path): " + ec.message()));
    }
    offload.io.nvme_path = offload.nvme_path;
  }
  if (r.uses_nvme && offload.nvme_path.empty()) {
    auto t = TempSwapDir::create();
    if (!t.ok()) return fail(t.status());
    r.temp_swap = std::move(*t);
    offload.nvme_path = {r.temp_swap->path()};
    offload.io.nvme_path = offload.nvme_path;
    // Nothing reopens it: the swap files go from the directory once open, so a killed run (where
    // ~TempSwapDir never runs) leaves only the small journal and lock files behind.
    offload.nvme_scratch = true;
  }
  return std::nullopt;
}

// --plan under a pipeline: every stage's plan (a function of the config alone), printed by rank 0.
int print_stage_plans(TrainRun& r) {
  const OffloadSettings& offload = r.offload;
  const std::int64_t pp = r.pp;
  for (int st = 0; st < static_cast<int>(pp); ++st) {
    OffloadSettings stage_settings = offload;
    stage_settings.pp_stage = st;
    auto sp = OffloadPlan::make(r.tc, stage_settings);
    if (!sp.ok()) return usage(sp.status().with_context("pipeline stage " + std::to_string(st)));
    const int v = offload.pipeline_virtual_stages;
    const std::vector<int>& b = offload.pipeline_bounds;
    std::string modules;  // "a-b", or the chunks' ranges "a-b, c-d" when interleaved
    for (int c = 0; c < v; ++c) {
      const auto j = static_cast<std::size_t>(c * pp + st);
      modules += (c > 0 ? ", " : "") + std::to_string(b[j]) + "-" + std::to_string(b[j + 1] - 1);
    }
    const std::string schedule = v > 1
                                     ? "interleaved 1f1b schedule, " + std::to_string(v) + " chunks per stage"
                                     : std::string(to_string(offload.pipeline_schedule)) + " schedule";
    std::printf("pipeline stage %d of %lld (modules %s, %s, every rank of the stage):\n%s", st,
                static_cast<long long>(pp), modules.c_str(), schedule.c_str(), sp->to_string().c_str());
  }
  return kExitOk;
}

// This rank's plan: the one OffloadEngine::create makes from its groups. With ZeRO the sharded
// state is this rank's 1/dp_size, so the device budget, the pinned pool and the fit check are
// sized for what the rank holds, not for one unsharded process; a pipeline stage places only its
// modules' state. --plan prints it and ends the run.
Exit make_plan(TrainRun& r) {
  OffloadSettings& offload = r.offload;
  if (r.pp > 1) {
    // create() picks the same stages.
    auto bounds =
        pipeline_stages(r.tc.model, static_cast<int>(r.pp) * offload.pipeline_virtual_stages, r.tc.seq_len);
    if (!bounds.ok()) {
      return usage(offload.pipeline_virtual_stages > 1
                       ? bounds.status().with_context("strata.pipeline_virtual_stages = " +
                                                      std::to_string(offload.pipeline_virtual_stages))
                       : bounds.status());
    }
    offload.pipeline_bounds = std::move(*bounds);
    offload.pp_stage = r.groups->coord.pp;
  }
  offload.dp_size = r.dp_size;
  Status s = offload.validate();
  if (!s.ok()) return usage(s);
  auto plan = OffloadPlan::make(r.tc, offload);
  if (!plan.ok()) return usage(plan.status());
  r.plan = std::move(*plan);
  if (!r.args.has("plan")) return std::nullopt;
  if (r.pp > 1) return print_stage_plans(r);
  if (r.dp_size > 1) std::printf("data parallel: %d ranks; the plan of each rank:\n", r.dp_size);
  std::printf("%s", r.plan->to_string().c_str());
  return kExitOk;
}

Exit open_device(TrainRun& r) {
  const OffloadSettings& offload = r.offload;
  const bool host_work = offload.params != Tier::kDevice || offload.optimizer != Tier::kDevice;
  Status s = device_options(r.args, r.plan->device_bytes, &r.options, &r.dc, host_work);
  if (!s.ok()) return s.code() == StatusCode::kInvalidArgument ? usage(s) : fail(s);
  r.tc.optimizer_isa = r.options.get_string(Option::kAdamIsa);
  if (r.plan->pinned_bytes + (64u << 20) > r.dc.pinned_bytes &&
      r.options.source(Option::kPinnedMemory) == "default") {
    r.dc.pinned_bytes = align_up(r.plan->pinned_bytes + (64u << 20), 1u << 20);
  }
  auto device = Device::create(r.dc);
  // A device this machine or build does not have (cuda without a GPU) is a wrong request, like
  // a bad flag: exit 2, as bench step does, not a run that failed.
  if (!device.ok() && device.status().code() == StatusCode::kUnavailable) {
    return usage_error("train",
                       "--device " + std::string(to_string(r.dc.kind)) + ": " + device.status().message(),
                       train_usage());
  }
  if (!device.ok()) return fail(device.status());
  r.device = std::move(*device);
  return std::nullopt;
}

Exit create_engine(TrainRun& r) {
  if (r.groups) {
    r.tp_group = std::move(r.groups->tp);
    r.pp_group = std::move(r.groups->pp);
    if (r.dp_size > 1) r.dp_group = std::move(r.groups->dp);
  } else if (r.ranks > 1) {
    // The optimizer on a GPU reduces device buffers (nccl); everything else host buffers (mpi).
    const CommBackend backend = r.offload.optimizer == Tier::kDevice && r.dc.kind == DeviceKind::kCuda
                                    ? CommBackend::kNccl
                                    : CommBackend::kMpi;
    auto w = r.comm_context->world(backend);
    if (!w.ok()) return fail(w.status().with_context("data-parallel group"));
    r.dp_group = std::move(*w);
  }
  auto engine = OffloadEngine::create(r.tc, r.offload, *r.device, nullptr, r.dp_group.get(), r.tp_group.get(),
                                      r.pp_group.get());
  if (!engine.ok()) return fail(engine.status());
  r.engine = std::move(*engine);
  r.trace_path = r.leader ? r.args.get("trace").value_or("") : "";
  r.observe.stream_times = r.metrics.is_open() || !r.trace_path.empty();
  r.observe.trace = !r.trace_path.empty();
  r.tr().observe(r.observe);
  r.trace_writer.reset(new TraceWriter{r.tr(), r.trace_path});
  return std::nullopt;
}

// What a checkpoint must agree on for the resumed run to see the batches the original would
// have: Batcher's batch i depends only on (tokens, B, T, seed).
Json data_identity(const TrainRun& r) {
  Json identity;
  identity["data"] = r.data.name;
  identity["tokenizer"] = r.data.tokenizer->name();
  identity["train_tokens"] = r.data.train.size();
  identity["train_tokens_crc32c"] = crc32c(r.data.train.data(), r.data.train.size() * sizeof(std::int32_t));
  identity["micro_batch"] = r.tc.micro_batch;
  identity["grad_accum"] =
      r.tc.grad_accum * r.dp_size;  // micro-batches per step, over all data-parallel ranks
  identity["seq_len"] = r.tc.seq_len;
  identity["seed"] = r.tc.seed;
  return identity;
}

Exit resume_if_asked(TrainRun& r) {
  r.identity = data_identity(r);
  auto path = r.args.get("resume");
  if (!path) return std::nullopt;
  auto m = r.tr().load_checkpoint(*path);
  if (!m.ok()) return fail(m.status().with_context("--resume"));
  const Json saved = Json::parse(m->client_state);
  for (auto it = r.identity.begin(); it != r.identity.end(); ++it) {
    if (!saved.contains(it.key()) || saved[it.key()] != it.value()) {
      return fail(failed_precondition(
          "--resume: checkpoint '" + m->dir + "' was trained with " + it.key() + " = " +
          (saved.contains(it.key()) ? saved[it.key()].dump() : std::string("(absent)")) + ", this run has " +
          it.value().dump() + "; resuming needs the same data, batch shape and seed"));
    }
  }
  r.first_step = m->step;
  if (r.first_step > r.steps) {
    return fail(failed_precondition("--resume: checkpoint '" + m->dir + "' is at step " +
                                    std::to_string(r.first_step) + "; --steps " + std::to_string(r.steps) +
                                    " leaves nothing to train"));
  }
  std::printf("resume   from %s (step %lld, saved with %s)\n", m->dir.c_str(),
              static_cast<long long>(r.first_step), m->placement.c_str());
  // A run stopped after its last checkpoint but before its outputs were written (killed while
  // saving the weights) resumes to write them.
  if (r.first_step == r.steps) std::printf("resume   nothing left to train: writing the run's outputs\n");
  return std::nullopt;
}

Status save_checkpoint(TrainRun& r) {
  auto dir =
      r.tr().save_checkpoint(r.checkpoint_dir, r.identity.dump(), static_cast<int>(r.keep_checkpoints));
  if (!dir.ok()) return dir.status();
  if (!r.args.has("quiet")) std::printf("  checkpoint %s\n", dir->c_str());
  return ok_status();
}

void print_parallel(TrainRun& r) {
  const OffloadSettings& offload = r.offload;
  const std::int64_t pp = r.pp;
  const int tp_size = r.tp_size, dp_size = r.dp_size;
  if (tp_size > 1) {
    std::printf(
        "parallel %d tensor-parallel ranks per %s (each holds 1/%d of the split parameters and "
        "trains its group's batch); the plan below is per rank\n",
        tp_size, pp > 1 ? "pipeline stage" : "model", tp_size);
    if (offload.sequence_parallel) {
      std::printf(
          "parallel sequence parallel: each tensor-parallel rank keeps 1/%d of the tokens of the residual "
          "stream and the norms\n",
          tp_size);
    }
  }
  if (pp > 1) {
    const int v = offload.pipeline_virtual_stages;
    if (v > 1) {
      // Interleaved: the v·p chunks in virtual-stage order (chunk j on stage j mod p).
      std::printf("parallel %lld pipeline stages (interleaved 1f1b schedule, %d chunks per stage), chunks",
                  static_cast<long long>(pp), v);
    } else {
      std::printf("parallel %lld pipeline stages (%s schedule), modules", static_cast<long long>(pp),
                  std::string(to_string(offload.pipeline_schedule)).c_str());
    }
    auto bounds = pipeline_stages(r.tc.model, static_cast<int>(pp) * v, r.tc.seq_len);
    for (std::size_t st = 0; bounds.ok() && st + 1 < bounds->size(); ++st)
      std::printf(" %d-%d", (*bounds)[st], (*bounds)[st + 1] - 1);
    std::printf(
        " (balanced by forward FLOPs), %d pipeline(s) of data parallel; the plan below is stage 0's\n",
        dp_size);
  } else if (dp_size > 1) {
    std::printf(
        "parallel %d data-parallel ranks (%s), ZeRO stage %d: %s; each rank trains %lld of the %lld "
        "micro-batches of a step; the plan below is per rank\n",
        dp_size, std::string(to_string(r.dp_group->backend())).c_str(),
        offload.optimizer != Tier::kDevice ? std::max(1, offload.zero_stage) : offload.zero_stage,
        offload.optimizer != Tier::kDevice ? "optimizer state and gradients sharded over the ranks"
        : offload.zero_stage >= 2
            ? "optimizer state sharded over the ranks in device memory, gradients reduce-scattered after "
              "backward (as stage 1: gradients and parameters are not yet sharded in device memory)"
        : offload.zero_stage == 1
            ? "optimizer state sharded over the ranks in device memory, gradients reduce-scattered"
            : "gradients all-reduced, optimizer state replicated",
        static_cast<long long>(r.tc.grad_accum), static_cast<long long>(r.tc.grad_accum * dp_size));
  }
}

void print_header(TrainRun& r) {
  const TrainerConfig& tc = r.tc;
  const OffloadSettings& offload = r.offload;
  const ModelLayout& layout = r.tr().model().layout();
  std::printf(
      "model    %s: %lld layers, width %lld, %lld heads, context %lld, vocab %lld, %s%s; %.2fM parameters\n",
      std::string(to_string(tc.model.kind)).c_str(), static_cast<long long>(tc.model.n_layer),
      static_cast<long long>(tc.model.n_embd), static_cast<long long>(tc.model.n_head),
      static_cast<long long>(tc.model.n_positions), static_cast<long long>(tc.model.vocab_size),
      std::string(to_string(tc.model.dtype)).c_str(),
      tc.model.activation_checkpointing ? ", activation checkpointing" : "",
      static_cast<double>(layout.num_parameters()) / 1e6);
  std::printf("data     %s (%s tokens): %s train / %s validation tokens; unigram entropy %.4f nats/token\n",
              r.data.name.c_str(), r.data.tokenizer->name().c_str(),
              thousands(static_cast<double>(r.data.train.size())).c_str(),
              thousands(static_cast<double>(r.data.validation.size())).c_str(), r.unigram);
  std::printf(
      "train    %lld steps x %lld tokens (batch %lld x accum %lld x seq %lld), %s, lr %g (warmup %lld, "
      "cosine "
      "to %g), weight decay %g, clip %g\n",
      static_cast<long long>(r.steps), static_cast<long long>(r.tokens_per_step()),
      static_cast<long long>(tc.micro_batch), static_cast<long long>(tc.grad_accum),
      static_cast<long long>(tc.seq_len), r.tr().optimizer_name().c_str(), tc.schedule.lr,
      static_cast<long long>(tc.schedule.warmup_steps), tc.schedule.lr * tc.schedule.min_ratio,
      tc.optimizer.weight_decay, tc.grad_clip);
  std::printf("device   %s, %d compute threads, %s budget\ncpus     %s\n", r.device->info().name.c_str(),
              r.device->info().compute_threads, format_bytes(r.device->info().memory_budget).c_str(),
              r.device->cpu_budget().to_string().c_str());
  print_parallel(r);
  std::printf("offload  parameters on %s, optimizer state on %s%s%s\n%s",
              std::string(to_string(offload.params)).c_str(),
              std::string(to_string(offload.optimizer)).c_str(), r.uses_nvme ? ", swap in " : "",
              r.uses_nvme ? offload.nvme_path.front().c_str() : "", r.tr().plan().to_string().c_str());
  if (offload.delayed_update) {
    std::printf(
        "offload  delayed update: each step computes with the parameters from before the previous step's "
        "update (not equivalent to the ordinary step); the first %d step(s) not delayed\n",
        offload.delayed_update_warmup);
  }
  if (offload.offload_activations) {
    std::printf(
        "offload  activations: the checkpointed block inputs in pinned host memory, a ring of %d on the "
        "device per micro-batch in flight\n",
        Model::kActivationRing);
  }
  std::fflush(stdout);
}

// The run's configuration goes to DIR/run.json first, so a run that stops early can still be
// reported; the summary is added at the end.
Exit write_run_config(TrainRun& r) {
  print_header(r);
  const TrainerConfig& tc = r.tc;
  const OffloadSettings& offload = r.offload;
  OffloadEngine& tr = r.tr();
  Json& run = r.run;
  run["model"] = Json::parse(model_config_to_json(tc.model));
  run["micro_batch"] = tc.micro_batch;
  run["grad_accum"] = tc.grad_accum;
  run["seq_len"] = tc.seq_len;
  run["seed"] = tc.seed;
  run["data"] = r.data.name;
  run["tokenizer"] = r.data.tokenizer->name();
  run["steps"] = r.steps;
  run["parameters"] = tr.model().layout().num_parameters();
  run["lr"] = tc.schedule.lr;
  run["warmup_steps"] = tc.schedule.warmup_steps;
  run["grad_clip"] = tc.grad_clip;
  run["weight_decay"] = tc.optimizer.weight_decay;
  run["optimizer"] = tr.optimizer_name();
  run["device"] = r.device->info().name;
  run["compute_threads"] = r.device->info().compute_threads;
  run["data_parallel"] = Json{{"ranks", r.dp_size}, {"zero_stage", offload.zero_stage}};
  run["tensor_parallel"] = Json{{"ranks", r.tp_size}, {"sequence_parallel", offload.sequence_parallel}};
  run["pipeline"] = Json{{"stages", r.pp},
                         {"schedule", std::string(to_string(offload.pipeline_schedule))},
                         {"virtual_stages", offload.pipeline_virtual_stages}};
  run["cpus"] = r.device->cpu_budget().to_string();
  run["offload"] = Json{{"param", std::string(to_string(offload.params))},
                        {"optimizer", std::string(to_string(offload.optimizer))},
                        {"gradients", std::string(to_string(offload.gradients))},
                        {"prefetch_modules", offload.prefetch_modules},
                        {"delayed_update", offload.delayed_update},
                        {"activations", offload.offload_activations}};
  run["plan"] = Json{{"device", tr.plan().device_bytes},
                     {"host", tr.plan().host_bytes},
                     {"pinned", tr.plan().pinned_bytes},
                     {"nvme", tr.plan().nvme_bytes}};
  run["stream_times"] = r.observe.stream_times;
  r.run_path = r.out_dir.empty() ? "" : (std::filesystem::path(r.out_dir) / "run.json").string();
  if (!r.run_path.empty()) {
    Status s = write_json_file(r.run_path, run);
    if (!s.ok()) return fail(s);
  }
  return std::nullopt;
}

// The step's grad_accum micro-batches of this rank, one after the other.
struct StepBatch {
  std::vector<std::int32_t> inputs, targets;
  std::vector<std::int32_t> mb_in, mb_tg;  // one micro-batch
};

void assemble_batch(TrainRun& r, std::int64_t step, StepBatch& b) {
  std::vector<std::int32_t>& inputs = b.inputs;
  std::vector<std::int32_t>& targets = b.targets;
  std::vector<std::int32_t>& mb_in = b.mb_in;
  std::vector<std::int32_t>& mb_tg = b.mb_tg;
  inputs.clear();
  targets.clear();
  for (std::int64_t a = 0; a < r.tc.grad_accum; ++a) {
    // Global micro-batch (step, a * dp_size + dp_rank): one process with grad_accum x dp_size sees
    // the same; the ranks of a tensor-parallel group train the same micro-batches.
    r.batcher->batch(static_cast<std::uint64_t>((step * r.tc.grad_accum + a) * r.dp_size + r.dp_rank), mb_in,
                     mb_tg);
    inputs.insert(inputs.end(), mb_in.begin(), mb_in.end());
    targets.insert(targets.end(), mb_tg.begin(), mb_tg.end());
  }
}

// How the progress line is shown: rewritten in place on a terminal, else one line every
// steps/20 steps (and at validations), nothing with --quiet.
struct ProgressLine {
  bool live = false;
  bool quiet = false;
  std::int64_t log_every = 1;
  Clock::time_point start;
  double recent_seconds = 0, recent_tokens = 0;  // moving averages for tokens/s

  void show(TrainRun& r, std::int64_t step, const StepMetrics& m, bool do_val, double elapsed) {
    const Progress& p = r.progress;
    recent_seconds = 0.8 * recent_seconds + 0.2 * m.seconds;
    recent_tokens = 0.8 * recent_tokens + 0.2 * static_cast<double>(m.tokens);
    if (step == r.first_step) {
      recent_seconds = m.seconds;
      recent_tokens = static_cast<double>(m.tokens);
    }
    const bool last = step + 1 == r.steps;
    const double eta =
        elapsed / static_cast<double>(step + 1 - r.first_step) * static_cast<double>(r.steps - step - 1);
    const double tok_s = recent_tokens / std::max(recent_seconds, 1e-9);
    char line[256];
    std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | lr %.2e | %s tok/s | %s elapsed | ETA %s",
                  static_cast<long long>(step + 1), static_cast<long long>(r.steps), m.loss, m.lr,
                  thousands(tok_s).c_str(), clock_text(elapsed).c_str(), clock_text(eta).c_str());
    if (r.tc.model.dtype == DType::kF16) {
      // The scale this step ran with and the overflowing steps skipped so far (this process).
      const std::size_t used = std::strlen(line);
      std::snprintf(line + used, sizeof line - used, " | scale %g | skipped %lld%s", m.loss_scale,
                    static_cast<long long>(p.skipped_steps), m.skipped ? " (this step)" : "");
    }
    if (live) {
      std::printf("\r\033[K%s", line);
      if (do_val)
        std::printf("\n  validation loss %.4f (%lld tokens)\n", p.last_val,
                    static_cast<long long>(p.val_tokens));
      std::fflush(stdout);
    } else if (!quiet && (step == r.first_step || last || (step + 1) % log_every == 0 || do_val)) {
      std::printf("%s", line);
      if (do_val) std::printf(" | val loss %.4f", p.last_val);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
};

Status validate(TrainRun& r) {
  auto v = r.tr().evaluate(r.data.validation, r.val_windows);
  if (!v.ok()) return v.status();
  r.progress.last_val = v->loss;
  r.progress.val_tokens = v->tokens;
  return ok_status();
}

// After a step: a checkpoint when one is due, and the stop the ranks agreed on. Returns whether
// the run stops here.
Result<bool> after_step(TrainRun& r, std::int64_t step, Comm* control, const ProgressLine& line) {
  Progress& p = r.progress;
  const bool last = step + 1 == r.steps;
  float flag = static_cast<float>(g_stop_signal);
  if (control) {
    Status s = control->all_reduce(&flag, &flag, 1, DType::kF32, ReduceOp::kMax).wait();
    if (!s.ok()) return s.with_context("after step " + std::to_string(step + 1));
  }
  p.stop_signal = static_cast<int>(flag);
  if (!r.checkpoint_dir.empty() &&
      (last || p.stop_signal != 0 || (r.checkpoint_every > 0 && (step + 1) % r.checkpoint_every == 0))) {
    if (line.live) std::printf("\n");
    Status c = save_checkpoint(r);
    if (!c.ok()) return c.with_context("checkpoint after step " + std::to_string(step + 1));
  }
  if (p.stop_signal == 0) return false;
  if (line.live) std::printf("\n");
  std::printf("stopping after step %lld/%lld: %s received%s\n", static_cast<long long>(step + 1),
              static_cast<long long>(r.steps), strsignal(p.stop_signal),
              r.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing to resume from)" : "");
  if (!r.checkpoint_dir.empty()) std::printf("  resume with: --resume %s\n", r.checkpoint_dir.c_str());
  std::fflush(stdout);
  p.end_step = step + 1;
  return true;
}

Exit train_loop(TrainRun& r) {
  std::signal(SIGTERM, request_stop);
  std::signal(SIGINT, request_stop);
  std::unique_ptr<Comm> control;  // under mpirun: the ranks agree on when to stop
  if (r.ranks > 1) {
    auto w = r.comm_context->world(CommBackend::kMpi);
    if (!w.ok()) return fail(w.status().with_context("control group"));
    control = std::move(*w);
  }
  Progress& p = r.progress;
  p.end_step = r.steps;
  ProgressLine line;
  line.live = !r.args.has("quiet") && ::isatty(STDOUT_FILENO) == 1;
  line.quiet = r.args.has("quiet");
  line.log_every = std::max<std::int64_t>(1, r.steps / 20);
  line.start = Clock::now();
  OffloadEngine& tr = r.tr();
  StepBatch batch;
  const bool fp16 = r.tc.model.dtype == DType::kF16;
  for (std::int64_t step = r.first_step; step < r.steps; ++step) {
    assemble_batch(r, step, batch);
    const OffloadStats before = r.metrics.is_open() ? tr.stats() : OffloadStats{};
    auto m = tr.step(batch.inputs, batch.targets);
    if (!m.ok()) {
      if (line.live) std::printf("\n");
      return fail(m.status().with_context("step " + std::to_string(step + 1)));
    }
    Json record;
    if (r.metrics.is_open()) record = step_record(*m, before, tr.stats(), tr.plan());
    if (fp16) {
      p.skipped_steps += m->skipped ? 1 : 0;
      p.last_scale = m->loss_scale;
      if (r.metrics.is_open()) {
        record["loss_scale"] = m->loss_scale;
        record["skipped"] = m->skipped;
      }
    }
    p.train_seconds += m->seconds;
    p.losses.push_back(m->loss);
    const bool last = step + 1 == r.steps;
    // Every rank validates: under stage 3 the forward gathers parameters from all of them, and a
    // pipeline's stages pass the activations along (the last stage's loss is every rank's).
    const bool do_val = r.can_validate && (last || (r.val_every > 0 && (step + 1) % r.val_every == 0));
    if (do_val) {
      Status v = validate(r);
      if (!v.ok()) return fail(v.with_context("validation"));
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - line.start).count();
    if (r.metrics.is_open()) {
      if (do_val) record["val_loss"] = p.last_val;
      record["elapsed_s"] = elapsed;
      r.metrics << record.dump() << '\n';
      r.metrics.flush();
      if (!r.metrics) return fail(io_error("cannot write the metrics file '" + r.metrics_path + "'"));
    }
    line.show(r, step, *m, do_val, elapsed);
    auto stop = after_step(r, step, control.get(), line);
    if (!stop.ok()) return fail(stop.status());
    if (*stop) break;
  }
  if (line.live) std::printf("\n");
  p.wall = std::chrono::duration<double>(Clock::now() - line.start).count();
  return std::nullopt;
}

// The mean loss of the last (up to) 10 steps, and how many it averages.
std::pair<double, std::size_t> recent_train_loss(const Progress& p) {
  const std::size_t tail = std::min<std::size_t>(p.losses.size(), 10);
  if (tail == 0) return {std::nan(""), 0};
  double loss = 0;
  for (std::size_t i = p.losses.size() - tail; i < p.losses.size(); ++i)
    loss += p.losses[i] / static_cast<double>(tail);
  return {loss, tail};
}

Json summary_json(TrainRun& r) {
  const Progress& p = r.progress;
  const auto [train_loss, tail] = recent_train_loss(p);
  Json summary;
  summary["steps"] = p.end_step;
  if (p.stop_signal != 0) summary["stopped_by"] = strsignal(p.stop_signal);
  summary["first_step"] = r.first_step + 1;
  if (tail > 0) {
    summary["train_loss"] = train_loss;
    summary["final_step_loss"] = p.losses.back();
  }
  if (r.can_validate && !std::isnan(p.last_val)) {
    summary["val_loss"] = p.last_val;
    summary["val_tokens"] = p.val_tokens;
  }
  summary["unigram_entropy"] = r.unigram;
  summary["wall_s"] = p.wall;
  summary["tokens_per_s"] =
      p.train_seconds > 0
          ? static_cast<double>(r.tokens_per_step() * (p.end_step - r.first_step)) / p.train_seconds
          : 0.0;
  summary["parameters"] = r.tr().model().layout().num_parameters();
  const OffloadStats os = r.tr().stats();
  summary["offload_param"] = std::string(to_string(r.offload.params));
  summary["offload_optimizer"] = std::string(to_string(r.offload.optimizer));
  summary["bytes_data_parallel"] = os.bytes_dp;
  summary["bytes_tensor_parallel"] = os.bytes_tp;
  summary["bytes_pipeline"] = os.bytes_pp;
  summary["bytes_h2d"] = os.bytes_h2d;
  summary["bytes_d2h"] = os.bytes_d2h;
  summary["bytes_nvme_read"] = os.bytes_nvme_read;
  summary["bytes_nvme_written"] = os.bytes_nvme_written;
  summary["prefetch_hit_rate"] = os.hit_rate();
  summary["allocations_after_warmup"] = os.allocations_after_warmup;
  return summary;
}

void print_summary(TrainRun& r, const Json& summary) {
  const Progress& p = r.progress;
  const auto [train_loss, tail] = recent_train_loss(p);
  const bool have_val = r.can_validate && !std::isnan(p.last_val);
  std::printf("\ndone: %lld steps in %s (%s tokens/s)\n", static_cast<long long>(p.end_step - r.first_step),
              clock_text(p.wall).c_str(), thousands(summary["tokens_per_s"].get<double>()).c_str());
  if (tail > 0)
    std::printf("  train loss       %.4f nats/token (mean of the last %zu steps)\n", train_loss, tail);
  if (r.tc.model.dtype == DType::kF16) {
    std::printf("  fp16             %lld of %lld steps skipped (gradients overflowed); last loss scale %g\n",
                static_cast<long long>(p.skipped_steps), static_cast<long long>(p.end_step - r.first_step),
                p.last_scale);
  }
  if (have_val) {
    std::printf("  validation loss  %.4f nats/token (%lld tokens)\n", p.last_val,
                static_cast<long long>(p.val_tokens));
  }
  std::printf("  unigram baseline %.4f nats/token (a model that knows only token frequencies)\n", r.unigram);
  const OffloadStats os = r.tr().stats();
  std::printf("  traffic          host->device %s, device->host %s, NVMe read %s, NVMe written %s\n",
              format_bytes(os.bytes_h2d).c_str(), format_bytes(os.bytes_d2h).c_str(),
              format_bytes(os.bytes_nvme_read).c_str(), format_bytes(os.bytes_nvme_written).c_str());
  if (r.offload.offload_activations) {
    std::printf("  activations      to host %s, back %s\n",
                format_bytes(os.bytes_activations_to_host).c_str(),
                format_bytes(os.bytes_activations_to_device).c_str());
  }
  std::printf(
      "  prefetch         %.1f%% of %llu parameter fetches issued ahead; %llu allocations after the "
      "first step; host optimizer %.1f s CPU\n",
      100.0 * os.hit_rate(), static_cast<unsigned long long>(os.param_accesses),
      static_cast<unsigned long long>(os.allocations_after_warmup), os.optimizer_cpu_seconds);
  if (have_val) std::printf("  validation loss is %.2f x the unigram baseline\n", p.last_val / r.unigram);
  if (auto w = r.args.get("save-weights"))
    std::printf("  weights (Hugging Face safetensors): %s\n", w->c_str());
  if (!r.out_dir.empty())
    std::printf("  run saved in %s (strata export --run %s --weights OUT; strata report %s)\n",
                r.out_dir.c_str(), r.out_dir.c_str(), r.out_dir.c_str());
  if (!r.trace_path.empty()) std::printf("  trace: %s (open in ui.perfetto.dev)\n", r.trace_path.c_str());
}

// The trace, the weights, run.json's summary and the printed one.
int finish(TrainRun& r) {
  Status s = r.trace_writer->write();
  if (!s.ok()) return fail(s);
  OffloadEngine& tr = r.tr();
  // Saving weights is collective under mpirun (stage 3 gathers the parameters); rank 0 writes.
  if (auto w = r.args.get("save-weights")) {
    s = tr.save_weights(*w, WeightFormat::kHuggingFace);
    if (!s.ok()) return fail(s);
  }
  const Json summary = summary_json(r);
  if (r.ranks > 1 && !r.leader && r.args.has("out")) {
    s = tr.save_weights((std::filesystem::path(*r.args.get("out")) / "weights.safetensors").string(),
                        WeightFormat::kNative);
    if (!s.ok()) return fail(s);
  }
  if (!r.out_dir.empty()) {
    s = tr.save_weights((std::filesystem::path(r.out_dir) / "weights.safetensors").string(),
                        WeightFormat::kNative);
    if (!s.ok()) return fail(s);
    r.run["summary"] = summary;
    s = write_json_file(r.run_path, r.run);
    if (!s.ok()) return fail(s);
  }
  print_summary(r, summary);
  return r.progress.stop_signal != 0 ? 128 + r.progress.stop_signal : kExitOk;
}

// The phases of a run, in order; each may end it.
constexpr Exit (*kPhases[])(TrainRun&) = {
    resolve_settings, start_ranks,      read_pipeline_settings,
    make_groups,      read_run_flags,   open_run_files,
    load_data,        check_model,      prepare_swap,
    make_plan,        open_device,      create_engine,
    resume_if_asked,  write_run_config, train_loop,
};

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
  TrainRun run(args);
  for (auto phase : kPhases) {
    if (Exit e = phase(run)) return *e;
  }
  return finish(run);
}

}  // namespace

STRATA_CLI_COMMAND(train,
                   "train a GPT (built-in corpus by default) and report loss against the unigram baseline",
                   run_train);

}  // namespace strata::cli
