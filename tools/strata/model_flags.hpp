// Flags shared by the commands that build a model (train, bench step): the model shape, and the
// device to run it on. Private to tools/strata.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "strata/device.hpp"
#include "strata/model.hpp"
#include "strata/options.hpp"

namespace strata::cli {

// The cpu backend's compute threads wait at OpenMP barriers many times per step. GNU OpenMP's
// default is to spin first; when the cores are shared (other processes, or host-side work beside
// the device threads) a spinning thread burns the time slice its partner needs, and a 2-thread
// step measured 3-4x slower than a 1-thread one. Passive waiting costs a few microseconds per
// parallel region on an idle machine. libgomp reads OMP_WAIT_POLICY once, when it is loaded, so
// a command that trains re-executes itself once with OMP_WAIT_POLICY=passive unless the
// variable is already set (an explicit setting is respected). Returns only if no re-exec happened.
inline void use_passive_openmp_wait(std::string_view command, std::span<const std::string> args) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (::setenv("OMP_WAIT_POLICY", "passive", 0) != 0) return;
  std::vector<std::string> words = {"strata", std::string(command)};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  ::execv("/proc/self/exe", argv.data());  // on failure: carry on with the spinning default
}

inline constexpr FlagSpec kModelFlags[] = {
    {"model", "gpt2|llama", "architecture (default gpt2)"},
    {"layers", "N", "transformer blocks"},
    {"heads", "N", "attention heads"},
    {"kv-heads", "N", "key/value heads (llama grouped-query attention; default = heads)"},
    {"width", "N", "model width (n_embd); a multiple of --heads"},
    {"context", "N", "context length n_positions (default = --seq-len)"},
    {"ffn", "N", "MLP hidden width (default 4·width for gpt2, ≈8/3·width for llama)"},
    {"dtype", "f32|bf16|fp16",
     "working dtype of weights and activations (bf16 and fp16 keep fp32 master weights; fp16 adds loss scaling)"},
    {"checkpointing", "on|off", "activation checkpointing: recompute each block in backward"},
    {"device", "cpu|cuda", "device backend (default: the 'device' tunable, cpu)"},
    {"threads", "N",
     "compute threads of the cpu backend (default: every allowed cpu when nothing is offloaded, else the "
     "compute_cpus of the cpu budget)"},
};

// Reads --name as an integer in [lo, hi]; a bad value is a usage error naming the flag, the
// value and the range. Absent flags leave *out as it is.
inline Status int_flag(const Args& args, std::string_view name, std::int64_t lo, std::int64_t hi,
                       std::int64_t* out) {
  auto v = args.get_int(name, *out, lo, hi);
  if (!v.ok()) return v.status();
  *out = *v;
  return ok_status();
}

inline Status double_flag(const Args& args, std::string_view name, double lo, double hi, double* out) {
  auto v = args.get_double(name, *out, lo, hi);
  if (!v.ok()) return v.status();
  *out = *v;
  return ok_status();
}

inline Status on_off_flag(const Args& args, std::string_view name, bool* out) {
  auto v = args.get(name);
  if (!v) return ok_status();
  if (*v == "on" || *v == "true" || *v == "1") {
    *out = true;
  } else if (*v == "off" || *v == "false" || *v == "0") {
    *out = false;
  } else {
    return invalid_argument("flag '--" + std::string(name) + "' expects on or off, got '" + *v + "'");
  }
  return ok_status();
}

// Applies the model-shape flags to `config` (seq_len: the default context).
inline Status apply_model_flags(const Args& args, std::int64_t seq_len, ModelConfig* config) {
  if (auto m = args.get("model")) {
    auto kind = parse_model_kind(*m);
    if (!kind.ok()) return kind.status().with_context("flag '--model'");
    config->kind = *kind;
  }
  STRATA_RETURN_IF_ERROR(int_flag(args, "layers", 1, 4096, &config->n_layer));
  STRATA_RETURN_IF_ERROR(int_flag(args, "heads", 1, 4096, &config->n_head));
  STRATA_RETURN_IF_ERROR(int_flag(args, "kv-heads", 0, 4096, &config->n_kv_head));
  STRATA_RETURN_IF_ERROR(int_flag(args, "width", 1, 1 << 17, &config->n_embd));
  config->n_positions = seq_len;
  STRATA_RETURN_IF_ERROR(int_flag(args, "context", 1, 1 << 20, &config->n_positions));
  STRATA_RETURN_IF_ERROR(int_flag(args, "ffn", 0, 1 << 20, &config->ffn_hidden));
  if (auto d = args.get("dtype")) {
    auto dtype = parse_dtype(*d);
    if (!dtype.ok()) return dtype.status().with_context("flag '--dtype'");
    config->dtype = *dtype;
  }
  STRATA_RETURN_IF_ERROR(on_off_flag(args, "checkpointing", &config->activation_checkpointing));
  if (config->n_embd % config->n_head != 0) {
    return invalid_argument("flag '--width' (" + std::to_string(config->n_embd) +
                            ") must be a multiple of --heads (" + std::to_string(config->n_head) + ")");
  }
  if (config->n_positions < seq_len) {
    return invalid_argument("flag '--context' (" + std::to_string(config->n_positions) +
                            ") must be at least --seq-len (" + std::to_string(seq_len) + ")");
  }
  Status s = config->validate();
  if (!s.ok()) return invalid_argument("bad model shape: " + s.message());
  return ok_status();
}

// --threads: 0 = the default.
inline constexpr std::int64_t kMaxComputeThreads = 4096;

// The device for a training command: the tunables (environment) with --device/--threads, and a
// memory budget of at least `needed`. The cpus are split by the device's CpuBudget
// (cpu_budget.hpp), the same split the host optimizer's threads come from; a run with no host
// engines (`host_work` false: nothing offloaded) gives compute every allowed cpu unless
// compute_threads or compute_cpus was set. Errors in flag values are usage errors
// (kInvalidArgument); others are failures.
inline Status device_options(const Args& args, std::uint64_t needed, Options* options, DeviceConfig* config,
                             bool host_work = false) {
  STRATA_RETURN_IF_ERROR(options->load_env());
  if (auto d = args.get("device")) {
    Status s = options->set(Option::kDevice, *d, "--device");
    if (!s.ok()) return invalid_argument("flag '--device': " + s.message());
  }
  if (auto t = args.get("threads")) {
    auto n = args.get_int("threads", 0, 0, kMaxComputeThreads);
    if (!n.ok()) return n.status();
    Status s = options->set(Option::kComputeThreads, std::to_string(*n), "--threads");
    if (!s.ok()) return invalid_argument("flag '--threads': " + s.message());
  }
  *config = DeviceConfig::from_options(*options);
  if (!host_work && options->source(Option::kComputeThreads) == "default" &&
      options->source(Option::kComputeCpus) == "default") {
    config->compute_threads = process_cpus().size();
  }
  if (options->source(Option::kDeviceMemory) == "default") {
    config->memory_bytes = std::max(config->memory_bytes, align_up(needed + needed / 4, 1u << 20));
  }
  return ok_status();
}

}  // namespace strata::cli
