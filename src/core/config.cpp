// The config schema: which keys exist at each level, their types, ranges and defaults, and the
// checks that span several keys. The generic reading and error collection is in config_reader.
#include "strata/config.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/config_reader.hpp"

namespace strata {
namespace {

using config_detail::Choice;
using config_detail::describe_value;
using config_detail::Json;
using config_detail::NumberRange;
using config_detail::ReadContext;
using config_detail::Section;

constexpr std::array<Choice<OffloadDevice>, 3> kOffloadDevices = {
    {{"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}}};
constexpr std::array<Choice<AioBackend>, 4> kAioBackends = {{{"auto", AioBackend::kAuto},
                                                             {"io_uring", AioBackend::kIoUring},
                                                             {"libaio", AioBackend::kLibaio},
                                                             {"psync", AioBackend::kPsync}}};
constexpr std::array<Choice<OptimizerType>, 4> kOptimizers = {{{"Adam", OptimizerType::kAdam},
                                                               {"AdamW", OptimizerType::kAdamW},
                                                               {"Lion", OptimizerType::kLion},
                                                               {"Adagrad", OptimizerType::kAdagrad}}};
constexpr std::array<Choice<SchedulerType>, 3> kSchedulers = {
    {{"WarmupLR", SchedulerType::kWarmupLR},
     {"WarmupCosineLR", SchedulerType::kWarmupCosineLR},
     {"WarmupDecayLR", SchedulerType::kWarmupDecayLR}}};
constexpr std::array<Choice<WarmupType>, 2> kWarmupTypes = {
    {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}}};

template <typename E, std::size_t N>
std::string_view name_of(const std::array<Choice<E>, N>& choices, E value) {
  for (const auto& c : choices) {
    if (c.value == value) return c.name;
  }
  return "none";
}

// The key table's pass over the file, before the sections are read: records "auto" values, ignored
// keys (in strict mode: errors) and refused keys (errors), and tells the reader which keys it has
// dealt with. Refused keys are erased so that the reader does not report them a second time.
void apply_key_table(Json* object, const std::string& section, ReadContext* ctx, Config* c, bool strict) {
  std::vector<std::string> erase;
  for (auto it = object->begin(); it != object->end(); ++it) {
    const std::string path = section.empty() ? it.key() : section + "." + it.key();
    c->present_paths.push_back(path);
    const ConfigKey* key = find_config_key(path);
    Json& value = it.value();
    if (key == nullptr) {
      if (value.is_object()) apply_key_table(&value, path, ctx, c, strict);
      continue;
    }
    if (value.is_string() && value.get_ref<const std::string&>() == "auto" && key->auto_ok) {
      c->auto_keys.push_back(path);
      ctx->mark_auto(path);
    } else if (value.is_string()) {
      // A refused value ("optimizer.type": "Lamb"). Lion and Adagrad are valid configs that this
      // engine cannot run: TrainerConfig::apply refuses them with the same row's note.
      const std::string& text = value.get_ref<const std::string&>();
      const bool engine_refuses =
          path == "optimizer.type" && (config_detail::equals_ignore_case(text, "Lion") ||
                                       config_detail::equals_ignore_case(text, "Adagrad"));
      const ConfigKey* refused = nullptr;
      for (const ConfigKey& k : config_keys()) {
        const std::string_view kp = k.path;
        if (k.use == KeyUse::kRefused && kp.size() == path.size() + 1 + text.size() &&
            kp.rfind(path + "=", 0) == 0 &&
            config_detail::equals_ignore_case(kp.substr(path.size() + 1), text)) {
          refused = &k;
        }
      }
      if (refused != nullptr && !engine_refuses) {
        ctx->errors.add(path, describe_value(value) + " is not supported: " + std::string(refused->note));
        ctx->mark_handled(path);
        erase.push_back(it.key());
        continue;
      }
    }
    switch (key->use) {
      case KeyUse::kHonoured:
        if (path == "optimizer.params" && std::find(erase.begin(), erase.end(), "type") != erase.end()) break;
        if (value.is_object() && !key->section) apply_key_table(&value, path, ctx, c, strict);
        break;
      case KeyUse::kIgnored:
        ctx->mark_handled(path);
        if (strict) {
          ctx->errors.add(
              path, "ignored by Strata (" + std::string(key->note) + "); --strict refuses ignored keys");
        } else {
          c->ignored.push_back({path, std::string(key->note)});
        }
        break;
      case KeyUse::kRefused:
        ctx->mark_handled(path);
        if (!key->inert.empty() && value.dump() == key->inert) break;  // what Strata does anyway
        ctx->errors.add(path, "not supported: " + std::string(key->note));
        erase.push_back(it.key());
        break;
    }
  }
  // A refused optimizer: its parameters cannot be checked against anything, and would only add noise.
  if (section == "optimizer" && std::find(erase.begin(), erase.end(), "type") != erase.end() &&
      object->contains("params")) {
    ctx->mark_handled("optimizer.params");
    erase.push_back("params");
  }
  for (const std::string& k : erase) object->erase(k);
}

// A batch size: a positive integer, or null for "derive it at launch".
void read_batch_key(Section& s, std::string_view key, std::optional<std::int64_t>* out) {
  if (const Json* v = s.declare(key); v != nullptr && v->is_null()) {
    out->reset();
    return;
  }
  std::int64_t v = 0;
  if (s.read_int(key, &v, 1)) *out = v;
}

void read_fp16(Section s, Fp16Config* c) {
  s.read_bool("enabled", &c->enabled);
  s.read_number("loss_scale", &c->loss_scale, NumberRange::at_least(0));
  s.read_int("initial_scale_power", &c->initial_scale_power, 0, 63);
  s.read_int("loss_scale_window", &c->loss_scale_window, 1);
  s.read_int("hysteresis", &c->hysteresis, 1);
  s.read_bool("consecutive_hysteresis", &c->consecutive_hysteresis);
  s.read_number("min_loss_scale", &c->min_loss_scale, NumberRange::above(0));
  s.finish();
}

void read_offload_param(Section s, OffloadParamConfig* c) {
  s.read_choice<OffloadDevice>("device", &c->device, kOffloadDevices, false);
  s.read_string("nvme_path", &c->nvme_path);
  s.read_bool("pin_memory", &c->pin_memory);
  s.read_int("buffer_count", &c->buffer_count, 1);
  s.read_count("buffer_size", &c->buffer_size, 1);
  s.read_count("max_in_cpu", &c->max_in_cpu, 0);
  s.finish();
}

void read_offload_optimizer(Section s, OffloadOptimizerConfig* c) {
  s.read_choice<OffloadDevice>("device", &c->device, kOffloadDevices, false);
  s.read_string("nvme_path", &c->nvme_path);
  s.read_bool("pin_memory", &c->pin_memory);
  s.read_int("buffer_count", &c->buffer_count, 1);
  s.read_bool("fast_init", &c->fast_init);
  s.read_number("ratio", &c->ratio, {0.0, false, 1.0, true});
  s.finish();
}

void read_zero(Section s, ZeroConfig* c) {
  s.read_int("stage", &c->stage, 0, 3);
  s.read_bool("contiguous_gradients", &c->contiguous_gradients);
  // DeepSpeed turns overlap_comm on by default for stage 3 only.
  c->overlap_comm = c->stage == 3;
  s.read_bool("overlap_comm", &c->overlap_comm);
  s.read_count("reduce_bucket_size", &c->reduce_bucket_size, 1);
  s.read_count("allgather_bucket_size", &c->allgather_bucket_size, 1);
  s.read_bool("allgather_partitions", &c->allgather_partitions);
  s.read_bool("reduce_scatter", &c->reduce_scatter);
  s.read_count("sub_group_size", &c->sub_group_size, 1);
  s.read_count("stage3_prefetch_bucket_size", &c->stage3_prefetch_bucket_size, 0);
  s.read_count("stage3_param_persistence_threshold", &c->stage3_param_persistence_threshold, 0);
  s.read_count("stage3_max_live_parameters", &c->stage3_max_live_parameters, 1);
  s.read_count("stage3_max_reuse_distance", &c->stage3_max_reuse_distance, 0);
  const bool has_new = s.has("stage3_gather_16bit_weights_on_model_save");
  s.read_bool("stage3_gather_16bit_weights_on_model_save", &c->stage3_gather_16bit_weights_on_model_save);
  // The older DeepSpeed spelling, still common in configs.
  if (has_new && s.has("stage3_gather_fp16_weights_on_model_save")) {
    s.reject("stage3_gather_fp16_weights_on_model_save",
             "is the old name of stage3_gather_16bit_weights_on_model_save; give only one of them");
  } else {
    s.read_bool("stage3_gather_fp16_weights_on_model_save", &c->stage3_gather_16bit_weights_on_model_save);
  }
  const bool has_param = s.has("offload_param"), has_optimizer = s.has("offload_optimizer");
  read_offload_param(s.child("offload_param"), &c->offload_param);
  read_offload_optimizer(s.child("offload_optimizer"), &c->offload_optimizer);
  // DeepSpeed's older boolean spellings of the offload sections.
  struct Alias {
    std::string_view key;
    bool conflicts;
    std::string_view instead;
  };
  for (const Alias& a : {Alias{"cpu_offload", has_optimizer, "offload_optimizer"},
                         Alias{"cpu_offload_params", has_param, "offload_param"}}) {
    bool on = false;
    if (s.has(a.key) && a.conflicts) {
      s.reject(a.key, "is the older spelling of " + std::string(a.instead) + "; give only one of them");
    } else if (s.read_bool(a.key, &on) && on) {
      (a.key == "cpu_offload" ? c->offload_optimizer.device : c->offload_param.device) = OffloadDevice::kCpu;
    }
  }
  if (bool pin = false; s.read_bool("cpu_offload_use_pin_memory", &pin) && pin) {
    c->offload_optimizer.pin_memory = true;
    c->offload_param.pin_memory = true;
  }
  s.finish();
}

void read_aio(Section s, AioConfig* c) {
  s.read_bytes("block_size", &c->block_size, 4096, 4096);
  s.read_int("queue_depth", &c->queue_depth, 1, 32768);
  if (s.has("intra_op_parallelism") && s.has("thread_count")) {
    s.read_int("intra_op_parallelism", &c->intra_op_parallelism, 1, 1024);
    s.reject("thread_count", "is DeepSpeed's older name for aio.intra_op_parallelism; give only one of them");
  } else {
    s.read_int("intra_op_parallelism", &c->intra_op_parallelism, 1, 1024);
    s.read_int("thread_count", &c->intra_op_parallelism, 1, 1024);
  }
  s.read_bool("single_submit", &c->single_submit);
  s.read_bool("overlap_events", &c->overlap_events);
  s.read_choice<AioBackend>("backend", &c->backend, kAioBackends, false);
  if (const Json* v = s.declare("nvme_path"); v != nullptr) {
    if (v->is_string()) {
      c->nvme_path = {v->get<std::string>()};
    } else if (v->is_array()) {
      std::vector<std::string> paths;
      bool ok = true;
      for (std::size_t i = 0; i < v->size(); ++i) {
        const Json& item = (*v)[i];
        const std::string key = "nvme_path[" + std::to_string(i) + "]";
        if (!item.is_string()) {
          s.expect(key, item, "a string", true);
          ok = false;
        } else if (item.get_ref<const std::string&>().empty()) {
          s.expect(key, item, "a directory path", false);
          ok = false;
        } else {
          paths.push_back(item.get<std::string>());
        }
      }
      if (ok) c->nvme_path = std::move(paths);
    } else {
      s.expect("nvme_path", *v, "a string or a list of strings", true);
    }
    if (c->nvme_path.size() == 1 && c->nvme_path[0].empty()) c->nvme_path.clear();
  }
  s.finish();
}

void read_optimizer(Section s, OptimizerConfig* c) {
  s.read_choice<OptimizerType>("type", &c->type, kOptimizers, /*ignore_case=*/true);
  switch (c->type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      *c = OptimizerConfig{c->type};
      break;
    case OptimizerType::kLion:
      *c = OptimizerConfig{c->type, 1e-3, {0.9, 0.999}, 0.0, 0.0, false};
      break;
    case OptimizerType::kAdagrad:
      *c = OptimizerConfig{c->type, 1e-2, {0.0, 0.0}, 1e-10, 0.0, false};
      break;
  }
  Section p = s.child("params");
  const std::string type_name(to_string(c->type));
  p.read_number("lr", &c->lr, NumberRange::at_least(0));
  if (c->type == OptimizerType::kAdagrad) {
    p.reject("betas", "is not used by Adagrad");
  } else if (const Json* v = p.declare("betas"); v != nullptr) {
    if (!v->is_array() || v->size() != 2) {
      p.expect("betas", *v, "a list of two numbers [beta1, beta2]", !v->is_array());
    } else {
      for (std::size_t i = 0; i < 2; ++i) {
        const Json& b = (*v)[i];
        const std::string key = "betas[" + std::to_string(i) + "]";
        const NumberRange range{0.0, true, 1.0, false};
        if (!b.is_number()) {
          p.expect(key, b, range.describe(), true);
        } else if (!range.contains(b.get<double>())) {
          p.expect(key, b, range.describe(), false);
        } else {
          c->betas[i] = b.get<double>();
        }
      }
    }
  }
  if (c->type == OptimizerType::kLion) {
    p.reject("eps", "is not used by Lion");
  } else {
    p.read_number("eps", &c->eps, NumberRange::above(0));
  }
  p.read_number("weight_decay", &c->weight_decay, NumberRange::at_least(0));
  if (c->type == OptimizerType::kAdam) {
    p.read_bool("adam_w_mode", &c->adam_w_mode);
  } else if (c->type == OptimizerType::kAdamW) {
    bool w = true;
    if (p.read_bool("adam_w_mode", &w) && !w) {
      p.error("adam_w_mode",
              "false contradicts optimizer.type \"AdamW\"; use type \"Adam\" for L2-coupled decay");
    }
  } else {
    p.reject("adam_w_mode", "only applies to Adam (optimizer.type is \"" + type_name + "\")");
  }
  p.finish();
  s.finish();
}

void read_scheduler(Section s, SchedulerConfig* c) {
  if (!s.present()) {
    // Declare the keys anyway so that a misplaced "scheduler" key gets a useful hint.
    s.declare("type");
    s.declare("params");
    return;
  }
  if (!s.has("type") && !s.context()->handled(s.key_path("type"))) {
    s.error("type", "missing; expected one of \"WarmupLR\", \"WarmupCosineLR\", \"WarmupDecayLR\"");
  }
  if (!s.read_choice<SchedulerType>("type", &c->type, kSchedulers, false)) {
    s.child("params");  // declared; its contents cannot be checked without a type
    s.finish();
    return;
  }
  Section p = s.child("params");
  const std::string type_name(to_string(c->type));
  const bool cosine = c->type == SchedulerType::kWarmupCosineLR;
  const bool needs_total = c->type != SchedulerType::kWarmupLR;
  if (cosine) {
    p.read_number("warmup_min_ratio", &c->warmup_min_ratio, {0.0, true, 1.0, true});
    p.read_number("cos_min_ratio", &c->cos_min_ratio, {0.0, true, 1.0, true});
    for (std::string_view key : {"warmup_min_lr", "warmup_max_lr"}) {
      p.reject(key,
               "is not a parameter of WarmupCosineLR, which scales the optimizer's lr by "
               "warmup_min_ratio and cos_min_ratio");
    }
  } else {
    p.read_number("warmup_min_lr", &c->warmup_min_lr, NumberRange::at_least(0));
    p.read_number("warmup_max_lr", &c->warmup_max_lr, NumberRange::at_least(0));
    for (std::string_view key : {"warmup_min_ratio", "cos_min_ratio"}) {
      p.reject(key, "is a parameter of WarmupCosineLR, not of " + type_name);
    }
  }
  p.read_int("warmup_num_steps", &c->warmup_num_steps, 0);
  p.read_choice<WarmupType>("warmup_type", &c->warmup_type, kWarmupTypes, false);
  if (needs_total) {
    const bool given = p.has("total_num_steps");
    if (p.read_int("total_num_steps", &c->total_num_steps, 1)) {
      // An "auto" warmup is resolved against the total later.
      if (c->warmup_num_steps > c->total_num_steps && !p.context()->is_auto(p.key_path("warmup_num_steps"))) {
        p.error("total_num_steps", "expected at least warmup_num_steps (" +
                                       std::to_string(c->warmup_num_steps) +
                                       (p.has("warmup_num_steps") ? "" : ", its default") + "), found " +
                                       std::to_string(c->total_num_steps));
      }
    } else if (!given) {
      p.error("total_num_steps", "missing; " + type_name + " needs the total number of training steps");
    }
  } else {
    p.reject("total_num_steps", "is not a parameter of WarmupLR (it holds warmup_max_lr after warmup)");
  }
  p.finish();
  s.finish();
}

// Precedence of a value's source, lowest first (options.hpp): default < config < environment < set.
int source_rank(const std::string& source) {
  if (source == "default") return 0;
  if (source.rfind("config ", 0) == 0) return 1;
  if (source.rfind("STRATA_", 0) == 0) return 2;
  return 3;
}

std::string option_text(const Json& v, OptionKind kind, bool* type_ok) {
  *type_ok = true;
  switch (kind) {
    case OptionKind::kInt:
      if (std::int64_t x = 0; config_detail::json_to_integer(v, &x)) return std::to_string(x);
      break;
    case OptionKind::kBytes:
      if (v.is_string()) return v.get<std::string>();
      if (std::int64_t x = 0; config_detail::json_to_integer(v, &x) && x >= 0) return std::to_string(x);
      break;
    case OptionKind::kBool:
      if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
      break;
    case OptionKind::kFloat:
      if (v.is_number()) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", v.get<double>());
        return buf;
      }
      break;
    case OptionKind::kString:
      if (v.is_string()) return v.get<std::string>();
      break;
  }
  *type_ok = false;
  return {};
}

std::string_view kind_expectation(OptionKind kind) {
  switch (kind) {
    case OptionKind::kInt:
      return "an integer";
    case OptionKind::kBytes:
      return "a byte size (an integer, or a string such as \"1MiB\")";
    case OptionKind::kBool:
      return "true or false";
    case OptionKind::kFloat:
      return "a number";
    case OptionKind::kString:
      return "a string";
  }
  return "a value";
}

void read_strata(Section s, Options* options) {
  for (const OptionDesc& d : option_table()) {
    const Json* v = s.declare(d.name);
    if (v == nullptr) continue;
    bool type_ok = false;
    const std::string text = option_text(*v, d.kind, &type_ok);
    if (!type_ok) {
      s.expect(d.name, *v, kind_expectation(d.kind), true);
      continue;
    }
    // Validate under the key path so that the error names it, then record the config source.
    Options scratch;
    if (Status st = scratch.set(d.id, text, s.key_path(d.name)); !st.ok()) {
      s.context()->errors.add("", st.message());
      continue;
    }
    if (source_rank(options->source(d.id)) <= 1) {
      Status st = options->set(d.id, text, "config " + s.key_path(d.name));
      (void)st;  // validated just above
    }
  }
  s.finish();
}

void apply_environment(Options* options, config_detail::ErrorList* errors) {
  for (const OptionDesc& d : option_table()) {
    const std::string env = Options::env_name(d);
    const char* value = std::getenv(env.c_str());
    if (value == nullptr || source_rank(options->source(d.id)) > 2) continue;
    if (Status st = options->set(d.id, value, env); !st.ok()) {
      errors->add_line("environment: " + st.message());
    }
  }
}

void check_cross_fields(const Config& c, ReadContext* ctx) {
  auto& errors = ctx->errors;
  if (c.fp16.enabled && c.bf16.enabled) {
    errors.add("fp16.enabled", "true together with bf16.enabled; enable at most one of fp16 and bf16");
  }
  const auto& z = c.zero_optimization;
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    errors.add(
        "zero_optimization.offload_param.device",
        "\"" + std::string(to_string(z.offload_param.device)) +
            "\" needs zero_optimization.stage 3 (parameters are only partitioned in stage 3), found stage " +
            std::to_string(z.stage));
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    errors.add("zero_optimization.offload_optimizer.device",
               "\"" + std::string(to_string(z.offload_optimizer.device)) +
                   "\" needs zero_optimization.stage 1, 2 or 3, found stage 0");
  }
  const bool have_aio_paths = !c.aio.nvme_path.empty();
  if (z.offload_param.device == OffloadDevice::kNvme && z.offload_param.nvme_path.empty() &&
      !have_aio_paths) {
    errors.add("zero_optimization.offload_param.nvme_path",
               "missing; device \"nvme\" needs a directory here or in aio.nvme_path");
  }
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.offload_optimizer.nvme_path.empty() &&
      !have_aio_paths) {
    errors.add("zero_optimization.offload_optimizer.nvme_path",
               "missing; device \"nvme\" needs a directory here or in aio.nvme_path");
  }
  // Batch sizes: what can be checked before the data-parallel size is known.
  const auto& batch = c.train_batch_size;
  const auto& micro = c.train_micro_batch_size_per_gpu;
  const auto& accum = c.gradient_accumulation_steps;
  if (batch && (micro || accum)) {
    const std::int64_t per_rank = micro.value_or(1) * accum.value_or(1);
    if (*batch % per_rank != 0) {
      std::string terms;
      if (micro) terms = "train_micro_batch_size_per_gpu (" + std::to_string(*micro) + ")";
      if (accum)
        terms += (terms.empty() ? "" : " * ") + std::string("gradient_accumulation_steps (") +
                 std::to_string(*accum) + ")";
      errors.add("train_batch_size",
                 "expected a multiple of " + terms + " = " + std::to_string(per_rank) +
                     " (train_batch_size = micro batch * accumulation steps * data-parallel "
                     "size), found " +
                     std::to_string(*batch));
    }
  }
}

// Every section of the file, in document order of the schema.
void read_sections(ReadContext* ctx, const Json& root, Config* config) {
  Config& c = *config;
  Section top(ctx, "", &root);
  read_batch_key(top, "train_batch_size", &c.train_batch_size);
  read_batch_key(top, "train_micro_batch_size_per_gpu", &c.train_micro_batch_size_per_gpu);
  read_batch_key(top, "gradient_accumulation_steps", &c.gradient_accumulation_steps);
  top.read_number("gradient_clipping", &c.gradient_clipping, NumberRange::at_least(0));
  top.read_int("steps_per_print", &c.steps_per_print, 1);
  read_fp16(top.child("fp16"), &c.fp16);
  if (top.has("bf16") && top.has("bfloat16")) {
    top.declare("bf16");
    top.reject("bfloat16", "is DeepSpeed's older name of the bf16 section; give only one of them");
  } else {
    for (std::string_view name : {"bf16", "bfloat16"}) {
      Section bf16 = top.child(name);
      bf16.read_bool("enabled", &c.bf16.enabled);
      bf16.finish();
    }
  }
  read_zero(top.child("zero_optimization"), &c.zero_optimization);
  read_aio(top.child("aio"), &c.aio);
  {
    Section ac = top.child("activation_checkpointing");
    ac.read_bool("cpu_checkpointing", &c.activation_checkpointing.cpu_checkpointing);
    ac.finish();
  }
  read_optimizer(top.child("optimizer"), &c.optimizer);
  read_scheduler(top.child("scheduler"), &c.scheduler);
  read_strata(top.child("strata"), &c.strata);
  top.finish();
}

}  // namespace

namespace config_detail {

// The key paths the reader reads (for the test that keeps the key table complete): those of an
// empty file plus those that only a scheduler of each kind reads.
std::vector<std::string> declared_key_paths() {
  std::vector<std::string> out;
  for (const char* text : {"{}", R"({"scheduler": {"type": "WarmupCosineLR", "params": {}}})",
                           R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})"}) {
    ReadContext ctx{"keys"};
    Config c;
    read_sections(&ctx, Json::parse(text), &c);
    for (std::string& p : ctx.registered_paths()) {
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace config_detail

std::string_view to_string(OffloadDevice value) { return name_of(kOffloadDevices, value); }
std::string_view to_string(AioBackend value) { return name_of(kAioBackends, value); }
std::string_view to_string(OptimizerType value) { return name_of(kOptimizers, value); }
std::string_view to_string(SchedulerType value) { return name_of(kSchedulers, value); }
std::string_view to_string(WarmupType value) { return name_of(kWarmupTypes, value); }

Result<BatchSizes> resolve_batch_sizes(const Config& config, std::int64_t data_parallel_size) {
  if (data_parallel_size < 1) {
    return invalid_argument("data-parallel size must be at least 1, got " +
                            std::to_string(data_parallel_size));
  }
  const std::int64_t dp = data_parallel_size;
  const auto& batch = config.train_batch_size;
  const auto& micro = config.train_micro_batch_size_per_gpu;
  const auto& accum = config.gradient_accumulation_steps;
  const std::string dp_text = "data-parallel size (" + std::to_string(dp) + ")";
  BatchSizes out;
  auto derive = [&](std::int64_t total, std::int64_t divisor, std::string_view derived_key,
                    const std::string& divisor_text) -> Result<std::int64_t> {
    if (total % divisor != 0) {
      return invalid_argument("train_batch_size (" + std::to_string(total) + ") is not divisible by " +
                              divisor_text + " = " + std::to_string(divisor) + ", so " +
                              std::string(derived_key) + " cannot be derived");
    }
    return total / divisor;
  };
  if (batch && micro && accum) {
    const std::int64_t product = *micro * *accum * dp;
    if (*batch != product) {
      return invalid_argument("train_batch_size (" + std::to_string(*batch) +
                              ") != train_micro_batch_size_per_gpu (" + std::to_string(*micro) +
                              ") * gradient_accumulation_steps (" + std::to_string(*accum) + ") * " +
                              dp_text + " = " + std::to_string(product));
    }
    out = {*batch, *micro, *accum};
  } else if (batch && micro) {
    STRATA_ASSIGN_OR_RETURN(std::int64_t a, derive(*batch, *micro * dp, "gradient_accumulation_steps",
                                                   "train_micro_batch_size_per_gpu (" +
                                                       std::to_string(*micro) + ") * " + dp_text));
    out = {*batch, *micro, a};
  } else if (batch) {
    const std::int64_t a = accum.value_or(1);
    const std::string divisor_text =
        accum ? "gradient_accumulation_steps (" + std::to_string(a) + ") * " + dp_text : dp_text;
    STRATA_ASSIGN_OR_RETURN(std::int64_t m,
                            derive(*batch, a * dp, "train_micro_batch_size_per_gpu", divisor_text));
    out = {*batch, m, a};
  } else {
    const std::int64_t m = micro.value_or(1), a = accum.value_or(1);
    out = {m * a * dp, m, a};
  }
  return out;
}

bool Config::is_auto(std::string_view path) const {
  return std::find(auto_keys.begin(), auto_keys.end(), path) != auto_keys.end();
}

bool Config::has(std::string_view path) const {
  return std::find(present_paths.begin(), present_paths.end(), path) != present_paths.end();
}

Result<Config> parse_config(std::string_view json_text, std::string_view source_name, Options* options,
                            ParseOptions parse) {
  ReadContext ctx{std::string(source_name)};
  STRATA_ASSIGN_OR_RETURN(Json root, config_detail::parse_json(json_text, &ctx.errors));
  if (!root.is_object()) {
    return invalid_argument(std::string(source_name) + ": expected a JSON object at the top level, found " +
                            config_detail::describe_type_and_value(root));
  }

  Config c;
  c.source = std::string(source_name);
  apply_key_table(&root, "", &ctx, &c, parse.strict);
  c.strata = options != nullptr ? *options : Options();
  read_sections(&ctx, root, &c);
  ctx.resolve_unknown_keys();
  check_cross_fields(c, &ctx);
  apply_environment(&c.strata, &ctx.errors);

  STRATA_RETURN_IF_ERROR(ctx.errors.to_status());
  if (options != nullptr) *options = c.strata;
  return c;
}

Result<Config> load_config_file(const std::string& path, Options* options, ParseOptions parse) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    std::string message = "config file '" + path + "': " + std::strerror(err);
    return err == ENOENT ? not_found(std::move(message)) : io_error(std::move(message));
  }
  std::string text;
  char buf[1 << 16];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return io_error("config file '" + path + "': read failed: " + std::strerror(err));
  return parse_config(text, path, options, parse);
}

std::string to_json(const Config& c) {
  auto optional_int = [](const std::optional<std::int64_t>& v) { return v ? Json(*v) : Json(nullptr); };
  Json j;
  j["train_batch_size"] = optional_int(c.train_batch_size);
  j["train_micro_batch_size_per_gpu"] = optional_int(c.train_micro_batch_size_per_gpu);
  j["gradient_accumulation_steps"] = optional_int(c.gradient_accumulation_steps);
  j["gradient_clipping"] = c.gradient_clipping;
  j["steps_per_print"] = c.steps_per_print;
  j["fp16"] = {{"enabled", c.fp16.enabled},
               {"loss_scale", c.fp16.loss_scale},
               {"initial_scale_power", c.fp16.initial_scale_power},
               {"loss_scale_window", c.fp16.loss_scale_window},
               {"hysteresis", c.fp16.hysteresis},
               {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
               {"min_loss_scale", c.fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", c.bf16.enabled}};

  const ZeroConfig& z = c.zero_optimization;
  Json zero;
  zero["stage"] = z.stage;
  zero["contiguous_gradients"] = z.contiguous_gradients;
  zero["overlap_comm"] = z.overlap_comm;
  zero["reduce_bucket_size"] = z.reduce_bucket_size;
  zero["allgather_bucket_size"] = z.allgather_bucket_size;
  zero["allgather_partitions"] = z.allgather_partitions;
  zero["reduce_scatter"] = z.reduce_scatter;
  zero["sub_group_size"] = z.sub_group_size;
  zero["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size;
  zero["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold;
  zero["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zero["stage3_max_reuse_distance"] = z.stage3_max_reuse_distance;
  zero["stage3_gather_16bit_weights_on_model_save"] = z.stage3_gather_16bit_weights_on_model_save;
  zero["offload_param"] = {
      {"device", to_string(z.offload_param.device)}, {"nvme_path", z.offload_param.nvme_path},
      {"pin_memory", z.offload_param.pin_memory},    {"buffer_count", z.offload_param.buffer_count},
      {"buffer_size", z.offload_param.buffer_size},  {"max_in_cpu", z.offload_param.max_in_cpu}};
  zero["offload_optimizer"] = {
      {"device", to_string(z.offload_optimizer.device)}, {"nvme_path", z.offload_optimizer.nvme_path},
      {"pin_memory", z.offload_optimizer.pin_memory},    {"buffer_count", z.offload_optimizer.buffer_count},
      {"fast_init", z.offload_optimizer.fast_init},      {"ratio", z.offload_optimizer.ratio}};
  j["zero_optimization"] = std::move(zero);

  j["aio"] = {{"block_size", c.aio.block_size},
              {"queue_depth", c.aio.queue_depth},
              {"intra_op_parallelism", c.aio.intra_op_parallelism},
              {"single_submit", c.aio.single_submit},
              {"overlap_events", c.aio.overlap_events},
              {"backend", to_string(c.aio.backend)},
              {"nvme_path", c.aio.nvme_path}};

  const OptimizerConfig& o = c.optimizer;
  Json params;
  params["lr"] = o.lr;
  if (o.type != OptimizerType::kAdagrad) params["betas"] = {o.betas[0], o.betas[1]};
  if (o.type != OptimizerType::kLion) params["eps"] = o.eps;
  params["weight_decay"] = o.weight_decay;
  if (o.type == OptimizerType::kAdam) params["adam_w_mode"] = o.adam_w_mode;
  j["optimizer"] = {{"type", to_string(o.type)}, {"params", std::move(params)}};

  const SchedulerConfig& s = c.scheduler;
  if (s.type == SchedulerType::kNone) {
    j["scheduler"] = nullptr;
  } else {
    Json sp;
    if (s.type == SchedulerType::kWarmupCosineLR) {
      sp["warmup_min_ratio"] = s.warmup_min_ratio;
      sp["cos_min_ratio"] = s.cos_min_ratio;
    } else {
      sp["warmup_min_lr"] = s.warmup_min_lr;
      sp["warmup_max_lr"] = s.warmup_max_lr;
    }
    sp["warmup_num_steps"] = s.warmup_num_steps;
    sp["warmup_type"] = to_string(s.warmup_type);
    if (s.type != SchedulerType::kWarmupLR) sp["total_num_steps"] = s.total_num_steps;
    j["scheduler"] = {{"type", to_string(s.type)}, {"params", std::move(sp)}};
  }

  Json strata = Json::object();
  for (const OptionDesc& d : option_table()) {
    const std::string key(d.name);
    switch (d.kind) {
      case OptionKind::kInt:
        strata[key] = c.strata.get_int(d.id);
        break;
      case OptionKind::kBytes:
        strata[key] = c.strata.get_bytes(d.id);
        break;
      case OptionKind::kBool:
        strata[key] = c.strata.get_bool(d.id);
        break;
      case OptionKind::kFloat:
        strata[key] = c.strata.get_float(d.id);
        break;
      case OptionKind::kString:
        strata[key] = c.strata.get_string(d.id);
        break;
    }
  }
  j["strata"] = std::move(strata);
  return j.dump(2, ' ', false, Json::error_handler_t::replace);
}

}  // namespace strata
