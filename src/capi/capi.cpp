// The C ABI of include/strata/strata.h over the C++ API (device.hpp, offload.hpp).
//
// Every entry point runs its body through guarded(): it clears the calling thread's error, turns
// a non-OK Status into its code plus a message prefixed with the function's name, and catches
// every exception (the C++ API reports errors as values, but a std::bad_alloc from a container
// may still escape it, and unwinding through a C frame is undefined behaviour).
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/build_config.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/model.hpp"
#include "strata/offload.hpp"
#include "strata/options.hpp"
#include "strata/status.hpp"
#include "strata/strata.h"

struct strata_device {
  std::unique_ptr<strata::Device> device;
  std::string name;
  // Engines alive on this device: destroying the device under one would free its arena.
  std::atomic<int> engines{0};
};

struct strata_engine {
  std::unique_ptr<strata::OffloadEngine> engine;
  strata_device* device = nullptr;
};

namespace strata {
namespace {

static_assert(static_cast<int>(StatusCode::kCancelled) == STRATA_CANCELLED,
              "strata_status must list StatusCode's values in the same order");
static_assert(static_cast<int>(StatusCode::kInvalidArgument) == STRATA_INVALID_ARGUMENT);
static_assert(static_cast<int>(StatusCode::kDeviceError) == STRATA_DEVICE_ERROR);

// Per thread, so that two threads driving two engines never read each other's message.
thread_local std::string t_last_error;

template <typename Body>
strata_status guarded(const char* function, Body&& body) noexcept {
  try {
    t_last_error.clear();
    Status s = body();
    if (s.ok()) return STRATA_OK;
    t_last_error = std::string(function) + ": " + s.message();
    return static_cast<strata_status>(s.code());
  } catch (const std::bad_alloc&) {
    try {
      t_last_error = std::string(function) + ": out of host memory";
    } catch (...) {
      t_last_error.clear();
    }
    return STRATA_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    try {
      t_last_error = std::string(function) + ": internal error: " + e.what();
    } catch (...) {
      t_last_error.clear();
    }
    return STRATA_INTERNAL;
  } catch (...) {
    t_last_error.clear();
    return STRATA_INTERNAL;
  }
}

Status null_argument(std::string_view name) {
  return invalid_argument("argument '" + std::string(name) + "' is NULL");
}

template <typename Settings>
Status check_struct_size(const Settings& s, std::string_view type) {
  if (s.struct_size != sizeof(Settings)) {
    return invalid_argument("settings.struct_size = " + std::to_string(s.struct_size) + ", expected sizeof(" +
                            std::string(type) + ") = " + std::to_string(sizeof(Settings)) +
                            " (initialise the struct with " + std::string(type) + "_init)");
  }
  return ok_status();
}

Status positive(std::string_view field, std::int64_t value) {
  if (value < 1) {
    return invalid_argument("settings." + std::string(field) + " = " + std::to_string(value) +
                            " must be >= 1");
  }
  return ok_status();
}

Result<Tier> tier_field(std::string_view field, const char* text) {
  if (text == nullptr) return Tier::kDevice;
  auto t = parse_tier(text);
  if (!t.ok()) return invalid_argument("settings." + std::string(field) + ": " + t.status().message());
  return *t;
}

// The struct's settings as the C++ API's, before any JSON config.
Status from_settings(const strata_engine_settings& s, TrainerConfig* tc, OffloadSettings* os) {
  STRATA_RETURN_IF_ERROR(check_struct_size(s, "strata_engine_settings"));
  if (s.model != nullptr) {
    auto kind = parse_model_kind(s.model);
    if (!kind.ok()) return invalid_argument("settings.model: " + kind.status().message());
    tc->model.kind = *kind;
  }
  STRATA_RETURN_IF_ERROR(positive("n_layer", s.n_layer));
  STRATA_RETURN_IF_ERROR(positive("n_embd", s.n_embd));
  STRATA_RETURN_IF_ERROR(positive("n_head", s.n_head));
  STRATA_RETURN_IF_ERROR(positive("vocab_size", s.vocab_size));
  STRATA_RETURN_IF_ERROR(positive("seq_len", s.seq_len));
  STRATA_RETURN_IF_ERROR(positive("micro_batch", s.micro_batch));
  STRATA_RETURN_IF_ERROR(positive("grad_accum", s.grad_accum));
  if (s.n_embd % s.n_head != 0) {
    return invalid_argument("settings.n_embd = " + std::to_string(s.n_embd) +
                            " is not a multiple of settings.n_head = " + std::to_string(s.n_head));
  }
  if (!(std::isfinite(s.lr) && s.lr > 0)) {
    return invalid_argument("settings.lr = " + std::to_string(s.lr) + " must be a finite number > 0");
  }
  if (!(std::isfinite(s.weight_decay) && s.weight_decay >= 0)) {
    return invalid_argument("settings.weight_decay = " + std::to_string(s.weight_decay) + " must be >= 0");
  }
  if (!(std::isfinite(s.grad_clip) && s.grad_clip >= 0)) {
    return invalid_argument("settings.grad_clip = " + std::to_string(s.grad_clip) +
                            " must be >= 0 (0 = off)");
  }
  if (s.warmup_steps < 0 || s.total_steps < 0) {
    return invalid_argument("settings.warmup_steps = " + std::to_string(s.warmup_steps) +
                            " and settings.total_steps = " + std::to_string(s.total_steps) + " must be >= 0");
  }
  if (s.total_steps > 0 && s.warmup_steps > s.total_steps) {
    return invalid_argument("settings.warmup_steps = " + std::to_string(s.warmup_steps) +
                            " exceeds settings.total_steps = " + std::to_string(s.total_steps));
  }
  tc->model.n_layer = s.n_layer;
  tc->model.n_embd = s.n_embd;
  tc->model.n_head = s.n_head;
  tc->model.vocab_size = s.vocab_size;
  tc->model.n_positions = s.seq_len;
  tc->seq_len = s.seq_len;
  tc->micro_batch = s.micro_batch;
  tc->grad_accum = s.grad_accum;
  tc->optimizer.lr = s.lr;
  tc->optimizer.weight_decay = s.weight_decay;
  tc->grad_clip = s.grad_clip;
  tc->seed = s.seed;
  LrSchedule& sched = tc->schedule;
  sched.lr = s.lr;
  sched.warmup_steps = s.warmup_steps;
  if (s.total_steps == 0 && s.warmup_steps == 0) {
    sched.kind = LrScheduleKind::kConstant;
  } else if (s.total_steps == 0) {
    sched.kind = LrScheduleKind::kWarmupLR;
    sched.warmup_min_lr = 0.0;
    sched.warmup_max_lr = s.lr;
  } else {
    sched.kind = LrScheduleKind::kWarmupCosine;
    sched.total_steps = s.total_steps;
    sched.min_ratio = 0.1;
  }
  STRATA_ASSIGN_OR_RETURN(os->params, tier_field("params_tier", s.params_tier));
  STRATA_ASSIGN_OR_RETURN(os->optimizer, tier_field("optimizer_tier", s.optimizer_tier));
  if (s.nvme_path != nullptr && *s.nvme_path != '\0') {
    os->nvme_path = {s.nvme_path};
    os->io.nvme_path = os->nvme_path;
  }
  return ok_status();
}

// Applies a DeepSpeed-style JSON config on top of the struct's settings. A section the text
// leaves out keeps the struct's value (the placement tiers and swap directory included).
Status apply_json(std::string_view text, TrainerConfig* tc, OffloadSettings* os) {
  Options options;
  STRATA_ASSIGN_OR_RETURN(Config config, parse_config(text, "json_config", &options));
  // parse_config validated the text, so this parse succeeds; it only tells which keys are present.
  const auto json = nlohmann::json::parse(text, nullptr, false, true);
  std::vector<std::string> keys;
  bool has_param_section = false, has_optimizer_section = false;
  if (json.is_object()) {
    for (auto it = json.begin(); it != json.end(); ++it) keys.push_back(it.key());
    if (auto z = json.find("zero_optimization"); z != json.end() && z->is_object()) {
      has_param_section = z->contains("offload_param");
      has_optimizer_section = z->contains("offload_optimizer");
    }
  }
  STRATA_RETURN_IF_ERROR(tc->apply(config, keys));
  // An optimizer section without a scheduler sets the peak lr; TrainerConfig::apply keeps the
  // schedule's kind, and kWarmupLR reads its peak from warmup_max_lr.
  const bool has_optimizer = json.contains("optimizer"), has_scheduler = json.contains("scheduler");
  if (has_optimizer && !has_scheduler && tc->schedule.kind == LrScheduleKind::kWarmupLR) {
    tc->schedule.warmup_max_lr = tc->schedule.lr;
  }
  const bool placement = json.contains("zero_optimization") || json.contains("aio");
  if (placement) {
    const OffloadSettings before = *os;
    STRATA_RETURN_IF_ERROR(os->apply(config));
    if (!has_param_section) os->params = before.params;
    if (!has_optimizer_section) os->optimizer = before.optimizer;
    if (os->nvme_path.empty()) {
      os->nvme_path = before.nvme_path;
      os->io.nvme_path = os->nvme_path;
    }
  }
  if (json.contains("strata")) tc->optimizer_isa = options.get_string(Option::kAdamIsa);
  return ok_status();
}

Status check_placement(const OffloadSettings& os) {
  if (os.params != Tier::kDevice && os.optimizer == Tier::kDevice) {
    return invalid_argument(
        "params_tier = '" + std::string(to_string(os.params)) +
        "' needs the optimizer off the device too: set optimizer_tier to 'host' or 'nvme' "
        "(zero_optimization.offload_optimizer.device in a JSON config)");
  }
  const bool nvme = os.params == Tier::kNvme || os.optimizer == Tier::kNvme;
  if (nvme && os.nvme_path.empty()) {
    return invalid_argument(
        "an 'nvme' tier needs a swap directory: set settings.nvme_path (or the JSON config's "
        "zero_optimization.offload_*.nvme_path / aio.nvme_path)");
  }
  if (nvme) {
    for (const std::string& dir : os.nvme_path) {
      struct stat st {};
      if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        return not_found("nvme_path '" + dir + "' is not an existing directory");
      }
    }
  }
  return ok_status();
}

}  // namespace
}  // namespace strata

using strata::guarded;
using strata::null_argument;
using strata::Status;

extern "C" {

const char* strata_version(int* major, int* minor, int* patch) {
  if (major != nullptr) *major = STRATA_VERSION_MAJOR;
  if (minor != nullptr) *minor = STRATA_VERSION_MINOR;
  if (patch != nullptr) *patch = STRATA_VERSION_PATCH;
  return STRATA_VERSION_STRING;
}

int strata_c_api_version(void) { return STRATA_C_API_VERSION; }

const char* strata_status_name(int status) {
  switch (status) {
    case STRATA_OK:
      return "OK";
    case STRATA_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case STRATA_NOT_FOUND:
      return "NOT_FOUND";
    case STRATA_OUT_OF_MEMORY:
      return "OUT_OF_MEMORY";
    case STRATA_IO_ERROR:
      return "IO_ERROR";
    case STRATA_DATA_LOSS:
      return "DATA_LOSS";
    case STRATA_UNAVAILABLE:
      return "UNAVAILABLE";
    case STRATA_FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case STRATA_INTERNAL:
      return "INTERNAL";
    case STRATA_DEVICE_ERROR:
      return "DEVICE_ERROR";
    case STRATA_CANCELLED:
      return "CANCELLED";
  }
  return "UNKNOWN";
}

const char* strata_last_error(void) { return strata::t_last_error.c_str(); }

void strata_device_settings_init(strata_device_settings* settings) {
  if (settings == nullptr) return;
  const strata::DeviceConfig defaults;
  *settings = strata_device_settings{};
  settings->struct_size = sizeof(strata_device_settings);
  settings->kind = "cpu";
  settings->ordinal = 0;
  settings->memory_bytes = defaults.memory_bytes;
  settings->pinned_bytes = defaults.pinned_bytes;
  settings->compute_threads = 0;
}

strata_status strata_device_create(const strata_device_settings* settings, strata_device** out) {
  return guarded("strata_device_create", [&]() -> Status {
    if (out == nullptr) return null_argument("out");
    *out = nullptr;
    strata_device_settings s;
    strata_device_settings_init(&s);
    if (settings != nullptr) {
      STRATA_RETURN_IF_ERROR(strata::check_struct_size(*settings, "strata_device_settings"));
      s = *settings;
    }
    strata::DeviceConfig dc;
    if (s.kind != nullptr) {
      auto kind = strata::parse_device_kind(s.kind);
      if (!kind.ok()) return strata::invalid_argument("settings.kind: " + kind.status().message());
      dc.kind = *kind;
    }
    if (s.ordinal < 0) {
      return strata::invalid_argument("settings.ordinal = " + std::to_string(s.ordinal) + " must be >= 0");
    }
    if (s.compute_threads < 0) {
      return strata::invalid_argument("settings.compute_threads = " + std::to_string(s.compute_threads) +
                                      " must be >= 0 (0 = half the cores)");
    }
    dc.ordinal = s.ordinal;
    if (s.memory_bytes != 0) dc.memory_bytes = s.memory_bytes;
    if (s.pinned_bytes != 0) dc.pinned_bytes = s.pinned_bytes;
    dc.compute_threads = s.compute_threads;
    auto device = strata::Device::create(dc);
    if (!device.ok()) return device.status();
    auto handle = std::make_unique<strata_device>();
    handle->name = (*device)->info().name;
    handle->device = std::move(*device);
    *out = handle.release();
    return strata::ok_status();
  });
}

strata_status strata_device_destroy(strata_device* device) {
  return guarded("strata_device_destroy", [&]() -> Status {
    if (device == nullptr) return strata::ok_status();
    if (const int n = device->engines.load(); n > 0) {
      return strata::failed_precondition("device '" + device->name + "' still has " + std::to_string(n) +
                                         " engine(s); destroy them first (strata_engine_destroy)");
    }
    delete device;
    return strata::ok_status();
  });
}

strata_status strata_device_name(const strata_device* device, const char** out) {
  return guarded("strata_device_name", [&]() -> Status {
    if (device == nullptr) return null_argument("device");
    if (out == nullptr) return null_argument("out");
    *out = device->name.c_str();
    return strata::ok_status();
  });
}

void strata_engine_settings_init(strata_engine_settings* settings) {
  if (settings == nullptr) return;
  *settings = strata_engine_settings{};
  settings->struct_size = sizeof(strata_engine_settings);
  settings->model = "gpt2";
  settings->n_layer = 4;
  settings->n_embd = 128;
  settings->n_head = 4;
  settings->vocab_size = 256;
  settings->seq_len = 64;
  settings->micro_batch = 4;
  settings->grad_accum = 1;
  settings->lr = 1e-3;
  settings->weight_decay = 0.0;
  settings->grad_clip = 1.0;
  settings->warmup_steps = 0;
  settings->total_steps = 0;
  settings->seed = 1234;
  settings->params_tier = "device";
  settings->optimizer_tier = "device";
  settings->nvme_path = nullptr;
}

strata_status strata_engine_create(strata_device* device, const strata_engine_settings* settings,
                                   const char* json_config, strata_engine** out) {
  return guarded("strata_engine_create", [&]() -> Status {
    if (out == nullptr) return null_argument("out");
    *out = nullptr;
    if (device == nullptr) return null_argument("device");
    strata_engine_settings s;
    strata_engine_settings_init(&s);
    if (settings != nullptr) s = *settings;
    strata::TrainerConfig tc;
    strata::OffloadSettings os;
    STRATA_RETURN_IF_ERROR(strata::from_settings(s, &tc, &os));
    if (json_config != nullptr) STRATA_RETURN_IF_ERROR(strata::apply_json(json_config, &tc, &os));
    STRATA_RETURN_IF_ERROR(strata::check_placement(os));
    STRATA_RETURN_IF_ERROR(tc.validate());
    STRATA_RETURN_IF_ERROR(os.validate());
    // One engine per device: the engine plans the whole arena. Claim the device before creating
    // so that two threads cannot both pass the check.
    int expected = 0;
    if (!device->engines.compare_exchange_strong(expected, 1)) {
      return strata::failed_precondition("device '" + device->name +
                                         "' already carries an engine; destroy it or create another device");
    }
    auto engine = strata::OffloadEngine::create(tc, os, *device->device);
    if (!engine.ok()) {
      device->engines.fetch_sub(1);
      return engine.status();
    }
    auto handle = std::make_unique<strata_engine>();
    handle->engine = std::move(*engine);
    handle->device = device;
    *out = handle.release();
    return strata::ok_status();
  });
}

void strata_engine_destroy(strata_engine* engine) {
  (void)guarded("strata_engine_destroy", [&]() -> Status {
    if (engine == nullptr) return strata::ok_status();
    strata_device* device = engine->device;
    // ~OffloadEngine waits for its threads; a failed update in flight has nobody left to tell.
    delete engine;
    device->engines.fetch_sub(1);
    return strata::ok_status();
  });
}

strata_status strata_engine_get_shape(const strata_engine* engine, strata_engine_shape* out) {
  return guarded("strata_engine_get_shape", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (out == nullptr) return null_argument("out");
    const strata::TrainerConfig& c = engine->engine->config();
    strata_engine_shape shape{};
    shape.micro_batch = c.micro_batch;
    shape.grad_accum = c.grad_accum;
    shape.seq_len = c.seq_len;
    shape.vocab_size = c.model.vocab_size;
    shape.tokens_per_step = c.grad_accum * c.micro_batch * c.seq_len;
    shape.parameters = engine->engine->model().layout().num_parameters();
    *out = shape;
    return strata::ok_status();
  });
}

strata_status strata_engine_step(strata_engine* engine, const int32_t* inputs, const int32_t* targets,
                                 size_t n_tokens, strata_step_result* out) {
  return guarded("strata_engine_step", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (inputs == nullptr) return null_argument("inputs");
    if (targets == nullptr) return null_argument("targets");
    if (out == nullptr) return null_argument("out");
    const strata::TrainerConfig& c = engine->engine->config();
    const auto expected = static_cast<std::size_t>(c.grad_accum * c.micro_batch * c.seq_len);
    if (n_tokens != expected) {
      return strata::invalid_argument("n_tokens = " + std::to_string(n_tokens) + ", expected grad_accum (" +
                                      std::to_string(c.grad_accum) + ") x micro_batch (" +
                                      std::to_string(c.micro_batch) + ") x seq_len (" +
                                      std::to_string(c.seq_len) + ") = " + std::to_string(expected));
    }
    auto m = engine->engine->step(std::span(inputs, n_tokens), std::span(targets, n_tokens));
    if (!m.ok()) return m.status();
    strata_step_result r{};
    r.step = m->step;
    r.loss = m->loss;
    r.grad_norm = m->grad_norm;
    r.lr = m->lr;
    r.tokens = m->tokens;
    r.seconds = m->seconds;
    r.loss_scale = m->loss_scale;
    r.skipped = m->skipped ? 1 : 0;
    *out = r;
    return strata::ok_status();
  });
}

strata_status strata_engine_synchronize(strata_engine* engine) {
  return guarded("strata_engine_synchronize", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    return engine->engine->synchronize();
  });
}

strata_status strata_engine_evaluate(strata_engine* engine, const int32_t* tokens, size_t n_tokens,
                                     int64_t max_windows, strata_eval_result* out) {
  return guarded("strata_engine_evaluate", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (tokens == nullptr) return null_argument("tokens");
    if (out == nullptr) return null_argument("out");
    if (max_windows < 0) {
      return strata::invalid_argument("max_windows = " + std::to_string(max_windows) +
                                      " must be >= 0 (0 = all)");
    }
    auto r = engine->engine->evaluate(std::span(tokens, n_tokens), max_windows);
    if (!r.ok()) return r.status();
    out->loss = r->loss;
    out->tokens = r->tokens;
    return strata::ok_status();
  });
}

strata_status strata_engine_save_weights(strata_engine* engine, const char* path) {
  return guarded("strata_engine_save_weights", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (path == nullptr) return null_argument("path");
    if (*path == '\0') return strata::invalid_argument("argument 'path' is empty");
    return engine->engine->save_weights(path, strata::WeightFormat::kHuggingFace);
  });
}

strata_status strata_engine_load_weights(strata_engine* engine, const char* path) {
  return guarded("strata_engine_load_weights", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (path == nullptr) return null_argument("path");
    if (*path == '\0') return strata::invalid_argument("argument 'path' is empty");
    return engine->engine->load_weights(path);
  });
}

strata_status strata_engine_get_stats(const strata_engine* engine, strata_stats* out) {
  return guarded("strata_engine_get_stats", [&]() -> Status {
    if (engine == nullptr) return null_argument("engine");
    if (out == nullptr) return null_argument("out");
    const strata::OffloadStats s = engine->engine->stats();
    const strata::OffloadPlan& plan = engine->engine->plan();
    strata_stats r{};
    r.steps = s.steps;
    r.bytes_h2d = s.bytes_h2d;
    r.bytes_d2h = s.bytes_d2h;
    r.bytes_nvme_read = s.bytes_nvme_read;
    r.bytes_nvme_written = s.bytes_nvme_written;
    r.param_accesses = s.param_accesses;
    r.prefetch_hits = s.prefetch_hits;
    r.prefetch_hit_rate = s.hit_rate();
    r.allocations_after_warmup = s.allocations_after_warmup;
    r.optimizer_cpu_seconds = s.optimizer_cpu_seconds;
    r.plan_device_bytes = plan.device_bytes;
    r.plan_host_bytes = plan.host_bytes;
    r.plan_pinned_bytes = plan.pinned_bytes;
    r.plan_nvme_bytes = plan.nvme_bytes;
    r.early_optimizer_reads = s.early_optimizer_reads;
    r.early_optimizer_reads_dropped = s.early_optimizer_reads_dropped;
    r.early_fetch_hits = s.early_fetch_hits;
    r.bytes_tp = s.bytes_tp;
    *out = r;
    return strata::ok_status();
  });
}

}  // extern "C"
