/* Strata's C ABI: the engine lifecycle for programs that are not C++ (C, Python through ctypes,
 * anything with a C FFI). It wraps the C++ API of offload.hpp and device.hpp; nothing C++ crosses
 * it: handles are opaque, every function returns a strata_status, and no exception ever leaves
 * the library (an unexpected one becomes STRATA_INTERNAL).
 *
 * Lifecycle:
 *   strata_device_create -> strata_engine_create -> strata_engine_step ... -> strata_engine_destroy
 *   -> strata_device_destroy
 *
 * Errors: when a call fails, strata_last_error() returns a message naming the argument, key,
 * path or value involved and what was expected. The message is per thread: every call except
 * strata_last_error, strata_status_name and strata_version clears it on entry, so it always
 * describes the latest failed call made by the calling thread. The string is owned by the
 * library and stays valid until the calling thread's next call into Strata.
 *
 * Ownership: the caller owns every handle it receives and releases it with the matching
 * _destroy function (destroying NULL is a no-op). An engine uses its device until the engine is
 * destroyed: strata_device_destroy on a device that still has an engine fails with
 * STRATA_FAILED_PRECONDITION and leaves the device alive. A device carries at most one engine
 * at a time (the engine plans the device's whole arena). Pointers passed in (token arrays,
 * strings, settings) are only read during the call; the library keeps no reference to them.
 * Out-structs are written only when the call returns STRATA_OK; a handle out-parameter is set
 * to NULL when the call fails.
 *
 * Threads: any number of devices and engines may be used from different threads at once. One
 * engine (and its device) must be driven from one thread at a time; calls on the same engine
 * from two threads at once need the caller's lock. strata_last_error is thread-safe (per
 * thread). The engine runs its own worker threads (device streams, host optimizer, NVMe I/O);
 * they are stopped by strata_engine_destroy.
 *
 * Versioning: STRATA_C_API_VERSION changes when the ABI changes incompatibly. The settings
 * structs start with `struct_size`; fill it (strata_*_settings_init does) so a newer library
 * can tell which fields an older caller knows.
 *
 * This header is C99 and C++ compatible and needs only <stddef.h> and <stdint.h>. */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define STRATA_C_EXPORT __attribute__((visibility("default")))
#else
#define STRATA_C_EXPORT
#endif

#define STRATA_C_API_VERSION 4

/* The same codes, in the same order, as strata::StatusCode (status.hpp). */
typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_INVALID_ARGUMENT = 1,    /* bad input from the caller: null, size, value, config key */
  STRATA_NOT_FOUND = 2,           /* a named file or device does not exist */
  STRATA_OUT_OF_MEMORY = 3,       /* a budget (device, pinned, host, swap space) is exhausted */
  STRATA_IO_ERROR = 4,            /* the OS reported an I/O failure */
  STRATA_DATA_LOSS = 5,           /* stored bytes are corrupt (checksum, truncated file) */
  STRATA_UNAVAILABLE = 6,         /* a backend is not in this build or on this machine */
  STRATA_FAILED_PRECONDITION = 7, /* the handle is in the wrong state for the call */
  STRATA_INTERNAL = 8,            /* a bug in Strata */
  STRATA_DEVICE_ERROR = 9,        /* the accelerator runtime reported an error */
  STRATA_CANCELLED = 10           /* work skipped because earlier work failed */
} strata_status;

typedef struct strata_device strata_device; /* opaque */
typedef struct strata_engine strata_engine; /* opaque */

/* ---- version and errors ------------------------------------------------------------------ */

/* The library's version ("0.1.0"); any of the out-pointers may be NULL. Never fails. */
STRATA_C_EXPORT const char* strata_version(int* major, int* minor, int* patch);
/* STRATA_C_API_VERSION of the library actually loaded (compare with the header's). */
STRATA_C_EXPORT int strata_c_api_version(void);
/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value outside the enum. Static storage. Takes an
   int (a strata_status converts to it) so that any value is valid to pass, in C and C++ alike. */
STRATA_C_EXPORT const char* strata_status_name(int status);
/* The message of the calling thread's latest failed call ("" when the latest call succeeded).
 * Never NULL. */
STRATA_C_EXPORT const char* strata_last_error(void);

/* ---- device ------------------------------------------------------------------------------ */

typedef struct strata_device_settings {
  size_t struct_size;    /* sizeof(strata_device_settings) */
  const char* kind;      /* "cpu" (the emulated accelerator) or "cuda"; NULL = "cpu" */
  int ordinal;           /* which GPU for "cuda" */
  uint64_t memory_bytes; /* device arena budget; 0 = 2 GiB */
  uint64_t pinned_bytes; /* pinned host pool; 0 = 512 MiB */
  int compute_threads;   /* cpu backend threads per stream; 0 = half the cores */
} strata_device_settings;

/* Fills the defaults above. */
STRATA_C_EXPORT void strata_device_settings_init(strata_device_settings* settings);
/* settings may be NULL (all defaults). "cuda" on a build or machine without a GPU fails with
 * STRATA_UNAVAILABLE (or STRATA_DEVICE_ERROR from the CUDA runtime) and a message saying so. */
STRATA_C_EXPORT strata_status strata_device_create(const strata_device_settings* settings,
                                                   strata_device** out);
/* Fails with STRATA_FAILED_PRECONDITION while an engine created on it is alive. */
STRATA_C_EXPORT strata_status strata_device_destroy(strata_device* device);
/* The device's name ("cpu:0 (emulated)", "NVIDIA H100 ..."); valid while the device lives. */
STRATA_C_EXPORT strata_status strata_device_name(const strata_device* device, const char** out);

/* ---- engine ------------------------------------------------------------------------------ */

typedef struct strata_engine_settings {
  size_t struct_size; /* sizeof(strata_engine_settings) */
  /* Model: a built-in GPT. */
  const char* model;   /* "gpt2" or "llama"; NULL = "gpt2" */
  int64_t n_layer;     /* default 4 */
  int64_t n_embd;      /* width; a multiple of n_head; default 128 */
  int64_t n_head;      /* default 4 */
  int64_t vocab_size;  /* token ids are 0..vocab_size-1; default 256 (bytes) */
  int64_t seq_len;     /* tokens per sequence; the context is seq_len; default 64 */
  int64_t micro_batch; /* sequences per micro-batch; default 4 */
  int64_t grad_accum;  /* micro-batches per step; default 1 */
  /* Optimizer (AdamW) and schedule. total_steps = 0: warm up linearly over warmup_steps, then
   * constant lr; total_steps > 0: warmup, then cosine decay to lr/10 at total_steps. */
  double lr;            /* default 1e-3 */
  double weight_decay;  /* default 0.0 */
  double grad_clip;     /* max global gradient norm; 0 = off; default 1.0 */
  int64_t warmup_steps; /* default 0 */
  int64_t total_steps;  /* default 0 */
  uint64_t seed;        /* parameter initialisation; default 1234 */
  /* Placement: "device" (DeepSpeed "none"), "host" ("cpu") or "nvme". */
  const char* params_tier;    /* working parameters; NULL = "device" */
  const char* optimizer_tier; /* fp32 master + Adam moments, and where Adam runs; NULL = "device" */
  const char* nvme_path;      /* swap directory (must exist); required when a tier is "nvme" */
} strata_engine_settings;

/* Fills the defaults above. */
STRATA_C_EXPORT void strata_engine_settings_init(strata_engine_settings* settings);

/* Plans, allocates everything and initialises the model on `device`. `settings` may be NULL
 * (defaults). `json_config` may be NULL; otherwise it is a DeepSpeed-style config (the keys of
 * docs/config.md: optimizer, scheduler, gradient_clipping, bf16, fp16, train_micro_batch_size_per_gpu,
 * gradient_accumulation_steps, zero_optimization.offload_param / offload_optimizer, aio, ...)
 * applied on top of `settings`; sections it leaves out keep the settings' values (a
 * zero_optimization section without offload_param keeps settings.params_tier, and so on). Of the
 * `strata` section only adam_isa applies here: the device already exists, with the budgets of
 * its strata_device_settings. Errors name the settings field or the config key. */
STRATA_C_EXPORT strata_status strata_engine_create(strata_device* device,
                                                   const strata_engine_settings* settings,
                                                   const char* json_config, strata_engine** out);
/* Waits for work in flight, stops the engine's threads and frees its memory. The swap files it
 * wrote under nvme_path (strata-swap.*) stay: the directory is the caller's to remove. */
STRATA_C_EXPORT void strata_engine_destroy(strata_engine* engine);

/* The shape the engine was created with (after the JSON config): tokens per step =
 * grad_accum * micro_batch * seq_len. */
typedef struct strata_engine_shape {
  int64_t micro_batch;
  int64_t grad_accum;
  int64_t seq_len;
  int64_t vocab_size;
  int64_t tokens_per_step;
  int64_t parameters; /* model parameters */
} strata_engine_shape;
STRATA_C_EXPORT strata_status strata_engine_get_shape(const strata_engine* engine, strata_engine_shape* out);

typedef struct strata_step_result {
  int64_t step;     /* 1-based number of this update */
  double loss;      /* mean cross-entropy over the step's tokens (nats) */
  double grad_norm; /* global gradient norm before clipping */
  double lr;        /* learning rate of this update */
  int64_t tokens;
  double seconds; /* wall time */
  /* fp16 (dynamic loss scaling): the scale this step's gradients carried (1 otherwise), and 1
   * when they overflowed so that the update was skipped (grad_norm is then inf or nan; the
   * parameters, Adam's step and the schedule did not advance). Added in C API version 2. */
  double loss_scale;
  int32_t skipped;
} strata_step_result;

/* One optimizer update. `inputs` and `targets` each hold exactly n_tokens = tokens_per_step token
 * ids, micro-batch after micro-batch, each row-major (micro_batch, seq_len). A target of -1 is
 * ignored by the loss. */
STRATA_C_EXPORT strata_status strata_engine_step(strata_engine* engine, const int32_t* inputs,
                                                 const int32_t* targets, size_t n_tokens,
                                                 strata_step_result* out);

/* strata_engine_step returns once the loss is known; with the optimizer off the device, the
 * update of the host (or NVMe) state and the upload of the new parameters may still run,
 * overlapped with the next call. This waits for all of it and reports the first error any
 * engine thread held. Statistics read after it are final. */
STRATA_C_EXPORT strata_status strata_engine_synchronize(strata_engine* engine);

typedef struct strata_eval_result {
  double loss;    /* mean next-token cross-entropy (nats) */
  int64_t tokens; /* predictions averaged */
} strata_eval_result;

/* Forward only over consecutive windows of seq_len+1 tokens from the start of `tokens` (a final
 * partial window is dropped), at most max_windows of them (0 = all). */
STRATA_C_EXPORT strata_status strata_engine_evaluate(strata_engine* engine, const int32_t* tokens,
                                                     size_t n_tokens, int64_t max_windows,
                                                     strata_eval_result* out);

/* Weights as safetensors with Hugging Face tensor names (loads in other tools). */
STRATA_C_EXPORT strata_status strata_engine_save_weights(strata_engine* engine, const char* path);
/* Loads a weights file (Hugging Face or Strata's native names) into the working and master
 * copies; its tensors must have this model's shapes. */
STRATA_C_EXPORT strata_status strata_engine_load_weights(strata_engine* engine, const char* path);

typedef struct strata_stats {
  int64_t steps;
  uint64_t bytes_h2d; /* traffic per link since create */
  uint64_t bytes_d2h;
  uint64_t bytes_nvme_read;
  uint64_t bytes_nvme_written;
  uint64_t param_accesses;  /* uses of non-resident module parameters */
  uint64_t prefetch_hits;   /* ... whose fetch had been issued ahead */
  double prefetch_hit_rate; /* prefetch_hits / param_accesses (1 when there were none) */
  uint64_t allocations_after_warmup;
  double optimizer_cpu_seconds;
  /* The plan: bytes per tier, fixed at create. */
  uint64_t plan_device_bytes;
  uint64_t plan_host_bytes;
  uint64_t plan_pinned_bytes;
  uint64_t plan_nvme_bytes;
  /* The NVMe optimizer's sub-group reads issued during backward (ahead of the update), and those
   * of them no update took over (a step that failed, or the engine stopping). Added in C API
   * version 3, which appended them (an out-struct that grows is an incompatible change). */
  uint64_t early_optimizer_reads;
  uint64_t early_optimizer_reads_dropped;
  /* Added in C API version 4, appended (the struct has no size field: growing it is an
   * incompatible change, hence the new version). Of prefetch_hits, those that found a copy
   * fetched early, when the previous step returned (docs/offload.md "Early fetch across steps").
   * bytes_tp: buffer bytes of the model's tensor-parallel collectives (docs/observability.md
   * `traffic.tensor_parallel`); 0 here, where the engine runs in one process. */
  uint64_t early_fetch_hits;
  uint64_t bytes_tp;
} strata_stats;
STRATA_C_EXPORT strata_status strata_engine_get_stats(const strata_engine* engine, strata_stats* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
