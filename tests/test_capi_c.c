/* strata.h from C: compiled as strict C99 (-Wpedantic -Werror), included twice to check its
 * include guard, linked against libstrata, and a few calls checked against what the header
 * promises. Returns non-zero and says which check failed. */
/* First and twice, before any other header. */
/* clang-format off */
#include "strata/strata.h"
#include "strata/strata.h"
/* clang-format on */

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "strata/build_config.hpp" /* plain preprocessor definitions: the version this build has */

static int failures = 0;

static void check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "FAILED: %s (last error: '%s')\n", what, strata_last_error());
    ++failures;
  }
}

int main(void) {
  int major = -1, minor = -1, patch = -1;
  const char* version = strata_version(&major, &minor, &patch);
  check(strcmp(version, STRATA_VERSION_STRING) == 0, "strata_version() returns the build's version string");
  check(major == STRATA_VERSION_MAJOR && minor == STRATA_VERSION_MINOR && patch == STRATA_VERSION_PATCH,
        "strata_version() returns the build's version numbers");
  check(strata_c_api_version() == STRATA_C_API_VERSION, "the library's C API version is the header's");
  check(STRATA_C_API_VERSION == 4, "the header is C API version 4");
  /* Version 4 appended early_fetch_hits and bytes_tp after version 3's last field: the fields
   * a version 3 caller knows keep their offsets. */
  check(offsetof(strata_stats, early_fetch_hits) ==
            offsetof(strata_stats, early_optimizer_reads_dropped) + sizeof(uint64_t),
        "strata_stats.early_fetch_hits follows version 3's last field");
  check(offsetof(strata_stats, bytes_tp) == offsetof(strata_stats, early_fetch_hits) + sizeof(uint64_t),
        "strata_stats.bytes_tp follows early_fetch_hits");
  check(sizeof(strata_stats) == offsetof(strata_stats, bytes_tp) + sizeof(uint64_t),
        "strata_stats ends with bytes_tp");
  check(strcmp(strata_status_name(STRATA_NOT_FOUND), "NOT_FOUND") == 0, "status name of STRATA_NOT_FOUND");
  check(strcmp(strata_status_name(99), "UNKNOWN") == 0,
        "status name of a value outside the enum");

  /* A bad argument is a status and a message naming it. */
  check(strata_device_create(NULL, NULL) == STRATA_INVALID_ARGUMENT,
        "device_create(NULL out) is INVALID_ARGUMENT");
  check(strstr(strata_last_error(), "'out'") != NULL, "the message names the argument 'out'");

  /* A successful call clears the thread's message. */
  strata_device_settings ds;
  strata_device_settings_init(&ds);
  ds.memory_bytes = 64u << 20;
  ds.pinned_bytes = 16u << 20;
  ds.compute_threads = 1;
  strata_device* device = NULL;
  check(strata_device_create(&ds, &device) == STRATA_OK && device != NULL, "cpu device_create succeeds");
  check(strcmp(strata_last_error(), "") == 0, "a successful call leaves an empty message");

  /* A tier the engine does not know is refused, naming the field and the value. */
  strata_engine_settings es;
  strata_engine_settings_init(&es);
  es.n_layer = 1;
  es.n_embd = 32;
  es.seq_len = 8;
  es.params_tier = "ssd";
  strata_engine* engine = NULL;
  check(strata_engine_create(device, &es, NULL, &engine) == STRATA_INVALID_ARGUMENT && engine == NULL,
        "engine_create with params_tier 'ssd' is INVALID_ARGUMENT");
  check(strstr(strata_last_error(), "params_tier") != NULL && strstr(strata_last_error(), "ssd") != NULL,
        "the message names params_tier and 'ssd'");

  /* Parameters and Adam on the host: from the second step on, the step starts on parameters
   * fetched early, when the previous step returned; strata_engine_get_stats reports those hits. */
  es.params_tier = "host";
  es.optimizer_tier = "host";
  es.vocab_size = 16;
  es.micro_batch = 1;
  /* Threshold 0: no module is persistent, every one is fetched. */
  check(strata_engine_create(device, &es,
                             "{\"zero_optimization\": {\"stage3_param_persistence_threshold\": 0}}",
                             &engine) == STRATA_OK &&
            engine != NULL,
        "engine_create with params and optimizer on the host succeeds");
  if (engine != NULL) {
    int32_t inputs[8], targets[8];
    for (int i = 0; i < 8; ++i) {
      inputs[i] = i % 5;
      targets[i] = (i + 1) % 5;
    }
    for (int step = 0; step < 3; ++step) {
      strata_step_result r;
      check(strata_engine_step(engine, inputs, targets, 8, &r) == STRATA_OK, "engine_step succeeds");
    }
    check(strata_engine_synchronize(engine) == STRATA_OK, "engine_synchronize succeeds");
    strata_stats st;
    memset(&st, 0xff, sizeof st);
    check(strata_engine_get_stats(engine, &st) == STRATA_OK, "engine_get_stats succeeds");
    check(st.steps == 3, "stats.steps is 3");
    check(st.early_fetch_hits > 0 && st.early_fetch_hits <= st.prefetch_hits,
          "stats.early_fetch_hits counts some of prefetch_hits");
    check(st.bytes_tp == 0, "stats.bytes_tp is 0 in one process");
    strata_engine_destroy(engine);
  }
  check(strata_device_destroy(device) == STRATA_OK, "device_destroy succeeds");
  check(strata_device_destroy(NULL) == STRATA_OK, "device_destroy(NULL) is a no-op");
  if (failures == 0) printf("strata.h as C99: all checks passed (Strata %s)\n", version);
  return failures == 0 ? 0 : 1;
}
