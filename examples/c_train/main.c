/* c_train: trains a small GPT from C through Strata's C ABI (strata.h), with the parameters on
 * NVMe (a fresh temporary directory), the optimizer state in host memory, on the cpu backend.
 * The data is the program's own: a synthetic corpus of short sentences, as byte tokens.
 *
 *   c_train [STEPS] [SWAP_PARENT_DIR]      (defaults: 40 steps, $TMPDIR or /tmp)
 *
 * Prints the loss of every step, then the validation loss before and after training and the
 * traffic the engine moved. Exits 1 on any error (the message says which call and why). */
#define _XOPEN_SOURCE 700 /* mkdtemp, nftw */

#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

enum { kSeqLen = 32, kBatch = 4, kCorpusBytes = 1 << 16 };

/* A small deterministic generator, so that every run sees the same data. */
static uint64_t rng_state = 88172645463325252ull;
static uint32_t next_random(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 32);
}

/* Sentences such as "alice gives bob 3 apples.\n": a grammar the model can learn quickly. */
static size_t make_corpus(int32_t* tokens, size_t capacity) {
  static const char* const names[] = {"alice", "bob", "carol", "dave", "erin", "frank"};
  static const char* const verbs[] = {"gives", "sells", "shows", "sends"};
  static const char* const things[] = {"apples", "pears", "books", "coins", "maps"};
  char line[96];
  size_t n = 0;
  for (;;) {
    int len =
        snprintf(line, sizeof line, "%s %s %s %u %s.\n", names[next_random() % 6], verbs[next_random() % 4],
                 names[next_random() % 6], 2 + next_random() % 8, things[next_random() % 5]);
    if (n + (size_t)len > capacity) return n;
    for (int i = 0; i < len; ++i) tokens[n++] = (unsigned char)line[i];
  }
}

static int remove_entry(const char* path, const struct stat* st, int type, struct FTW* ftw) {
  (void)st, (void)type, (void)ftw;
  return remove(path);
}

static int fail(const char* call, strata_status status) {
  fprintf(stderr, "c_train: %s failed: %s: %s\n", call, strata_status_name(status), strata_last_error());
  return 1;
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : 40;
  if (steps < 1) {
    fprintf(stderr, "c_train: STEPS '%s' must be a positive number\n", argv[1]);
    return 2;
  }
  const char* tmp = argc > 2 ? argv[2] : getenv("TMPDIR");
  char swap_dir[4096];
  snprintf(swap_dir, sizeof swap_dir, "%s/c_train-swap-XXXXXX", tmp != NULL && *tmp != '\0' ? tmp : "/tmp");
  if (mkdtemp(swap_dir) == NULL) {
    perror("c_train: cannot create the swap directory");
    return 1;
  }

  /* 90% of the corpus trains, the rest validates. */
  static int32_t corpus[kCorpusBytes];
  const size_t n_corpus = make_corpus(corpus, kCorpusBytes);
  const size_t n_train = n_corpus * 9 / 10;
  const int32_t* validation = corpus + n_train;
  const size_t n_validation = n_corpus - n_train;

  int rc = 1;
  strata_status st;
  strata_device* device = NULL;
  strata_engine* engine = NULL;
  strata_stats stats;
  strata_eval_result before, after;
  int32_t inputs[kBatch * kSeqLen], targets[kBatch * kSeqLen];
  strata_device_settings ds;
  strata_engine_settings es;
  strata_device_settings_init(&ds);
  ds.memory_bytes = 256u << 20;
  ds.pinned_bytes = 64u << 20;
  if ((st = strata_device_create(&ds, &device)) != STRATA_OK) {
    rc = fail("strata_device_create", st);
    goto done;
  }

  strata_engine_settings_init(&es);
  es.n_layer = 2;
  es.n_embd = 128; /* a block holds ~200k parameters: above the persistence threshold, so it moves */
  es.n_head = 4;
  es.vocab_size = 256;
  es.seq_len = kSeqLen;
  es.micro_batch = kBatch;
  es.lr = 3e-3;
  es.warmup_steps = steps > 2 ? 2 : 0; /* warmup_steps may not exceed total_steps */
  es.total_steps = steps;
  es.params_tier = "nvme";
  es.optimizer_tier = "host";
  es.nvme_path = swap_dir;
  if ((st = strata_engine_create(device, &es, NULL, &engine)) != STRATA_OK) {
    rc = fail("strata_engine_create", st);
    goto done;
  }
  strata_engine_get_stats(engine, &stats);
  printf("c_train: Strata %s, %s; plan: device %llu, host %llu, nvme %llu bytes (swap in %s)\n",
         strata_version(NULL, NULL, NULL), "params on nvme, optimizer on host",
         (unsigned long long)stats.plan_device_bytes, (unsigned long long)stats.plan_host_bytes,
         (unsigned long long)stats.plan_nvme_bytes, swap_dir);

  if ((st = strata_engine_evaluate(engine, validation, n_validation, 16, &before)) != STRATA_OK) {
    rc = fail("strata_engine_evaluate", st);
    goto done;
  }

  /* Each step: kBatch random windows of the training text; targets are the inputs shifted by one. */
  for (int step = 0; step < steps; ++step) {
    for (int b = 0; b < kBatch; ++b) {
      const size_t start = next_random() % (n_train - kSeqLen - 1);
      memcpy(inputs + b * kSeqLen, corpus + start, kSeqLen * sizeof(int32_t));
      memcpy(targets + b * kSeqLen, corpus + start + 1, kSeqLen * sizeof(int32_t));
    }
    strata_step_result r;
    if ((st = strata_engine_step(engine, inputs, targets, kBatch * kSeqLen, &r)) != STRATA_OK) {
      rc = fail("strata_engine_step", st);
      goto done;
    }
    strata_engine_get_stats(engine, &stats);
    printf("step %d loss %.4f grad_norm %.3f lr %.2e nvme_read %llu prefetch_hit_rate %.2f\n", (int)r.step,
           r.loss, r.grad_norm, r.lr, (unsigned long long)stats.bytes_nvme_read, stats.prefetch_hit_rate);
  }

  if ((st = strata_engine_evaluate(engine, validation, n_validation, 16, &after)) != STRATA_OK) {
    rc = fail("strata_engine_evaluate", st);
    goto done;
  }
  strata_engine_get_stats(engine, &stats);
  printf("validation loss %.4f -> %.4f over %lld tokens\n", before.loss, after.loss, (long long)after.tokens);
  printf("traffic: host->device %llu, device->host %llu, nvme read %llu, nvme written %llu bytes\n",
         (unsigned long long)stats.bytes_h2d, (unsigned long long)stats.bytes_d2h,
         (unsigned long long)stats.bytes_nvme_read, (unsigned long long)stats.bytes_nvme_written);
  rc = 0;

done:
  strata_engine_destroy(engine);
  if ((st = strata_device_destroy(device)) != STRATA_OK) rc = fail("strata_device_destroy", st);
  nftw(swap_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS); /* the engine's swap files, then the directory */
  return rc;
}
