#!/usr/bin/env python3
"""Train a small GPT from Python through Strata's C ABI (include/strata/strata.h) with ctypes.

Parameters live on NVMe (a fresh temporary directory), the optimizer state in host memory, on
the cpu backend. The data is this program's own: a synthetic corpus of short sentences, as byte
tokens. Needs only the Python standard library and libstrata.so:

    python3 train.py --lib <prefix>/lib/libstrata.so [--steps 40]

Prints the loss of every step, the validation loss before and after, and the traffic moved.
"""
import argparse
import ctypes
import ctypes.util
import os
import random
import shutil
import sys
import tempfile

STRATA_OK = 0
C_API_VERSION = 4  # the STRATA_C_API_VERSION these structs mirror


class DeviceSettings(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("kind", ctypes.c_char_p),
        ("ordinal", ctypes.c_int),
        ("memory_bytes", ctypes.c_uint64),
        ("pinned_bytes", ctypes.c_uint64),
        ("compute_threads", ctypes.c_int),
    ]


class EngineSettings(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("model", ctypes.c_char_p),
        ("n_layer", ctypes.c_int64),
        ("n_embd", ctypes.c_int64),
        ("n_head", ctypes.c_int64),
        ("vocab_size", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("micro_batch", ctypes.c_int64),
        ("grad_accum", ctypes.c_int64),
        ("lr", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("grad_clip", ctypes.c_double),
        ("warmup_steps", ctypes.c_int64),
        ("total_steps", ctypes.c_int64),
        ("seed", ctypes.c_uint64),
        ("params_tier", ctypes.c_char_p),
        ("optimizer_tier", ctypes.c_char_p),
        ("nvme_path", ctypes.c_char_p),
    ]


class StepResult(ctypes.Structure):
    _fields_ = [
        ("step", ctypes.c_int64),
        ("loss", ctypes.c_double),
        ("grad_norm", ctypes.c_double),
        ("lr", ctypes.c_double),
        ("tokens", ctypes.c_int64),
        ("seconds", ctypes.c_double),
        ("loss_scale", ctypes.c_double),
        ("skipped", ctypes.c_int32),
    ]


class EvalResult(ctypes.Structure):
    _fields_ = [("loss", ctypes.c_double), ("tokens", ctypes.c_int64)]


class Stats(ctypes.Structure):
    _fields_ = [
        ("steps", ctypes.c_int64),
        ("bytes_h2d", ctypes.c_uint64),
        ("bytes_d2h", ctypes.c_uint64),
        ("bytes_nvme_read", ctypes.c_uint64),
        ("bytes_nvme_written", ctypes.c_uint64),
        ("param_accesses", ctypes.c_uint64),
        ("prefetch_hits", ctypes.c_uint64),
        ("prefetch_hit_rate", ctypes.c_double),
        ("allocations_after_warmup", ctypes.c_uint64),
        ("optimizer_cpu_seconds", ctypes.c_double),
        ("plan_device_bytes", ctypes.c_uint64),
        ("plan_host_bytes", ctypes.c_uint64),
        ("plan_pinned_bytes", ctypes.c_uint64),
        ("plan_nvme_bytes", ctypes.c_uint64),
        ("early_optimizer_reads", ctypes.c_uint64),
        ("early_optimizer_reads_dropped", ctypes.c_uint64),
        ("early_fetch_hits", ctypes.c_uint64),
        ("bytes_tp", ctypes.c_uint64),
    ]


class StrataError(RuntimeError):
    pass


class Strata:
    """The few entry points this example uses, with argument types declared."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        P = ctypes.POINTER
        i32p = P(ctypes.c_int32)
        sig = {
            "strata_version": (ctypes.c_char_p, [P(ctypes.c_int)] * 3),
            "strata_c_api_version": (ctypes.c_int, []),
            "strata_status_name": (ctypes.c_char_p, [ctypes.c_int]),
            "strata_last_error": (ctypes.c_char_p, []),
            "strata_device_settings_init": (None, [P(DeviceSettings)]),
            "strata_device_create": (ctypes.c_int, [P(DeviceSettings), P(ctypes.c_void_p)]),
            "strata_device_destroy": (ctypes.c_int, [ctypes.c_void_p]),
            "strata_engine_settings_init": (None, [P(EngineSettings)]),
            "strata_engine_create": (ctypes.c_int, [ctypes.c_void_p, P(EngineSettings), ctypes.c_char_p,
                                                    P(ctypes.c_void_p)]),
            "strata_engine_destroy": (None, [ctypes.c_void_p]),
            "strata_engine_step": (ctypes.c_int, [ctypes.c_void_p, i32p, i32p, ctypes.c_size_t, P(StepResult)]),
            "strata_engine_evaluate": (ctypes.c_int, [ctypes.c_void_p, i32p, ctypes.c_size_t, ctypes.c_int64,
                                                      P(EvalResult)]),
            "strata_engine_get_stats": (ctypes.c_int, [ctypes.c_void_p, P(Stats)]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self.lib = lib
        if lib.strata_c_api_version() != C_API_VERSION:
            raise StrataError(f"{path} has C API version {lib.strata_c_api_version()}, this script "
                              f"mirrors version {C_API_VERSION}")

    def check(self, call, status):
        if status != STRATA_OK:
            name = self.lib.strata_status_name(status).decode()
            raise StrataError(f"{call} failed: {name}: {self.lib.strata_last_error().decode()}")

    def version(self):
        return self.lib.strata_version(None, None, None).decode()


def make_corpus(n_bytes, rng):
    """Sentences such as "alice gives bob 3 apples.": a grammar the model learns quickly."""
    names = ["alice", "bob", "carol", "dave", "erin", "frank"]
    verbs = ["gives", "sells", "shows", "sends"]
    things = ["apples", "pears", "books", "coins", "maps"]
    out = bytearray()
    while True:
        line = (f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(names)} "
                f"{rng.randint(2, 9)} {rng.choice(things)}.\n").encode()
        if len(out) + len(line) > n_bytes:
            return bytes(out)
        out += line


def library_path(arg):
    if arg:
        return arg
    if os.environ.get("STRATA_LIBRARY"):
        return os.environ["STRATA_LIBRARY"]
    found = ctypes.util.find_library("strata")
    if not found:
        sys.exit("train.py: libstrata not found; pass --lib PATH or set STRATA_LIBRARY")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="path of libstrata.so (default: $STRATA_LIBRARY, then the linker's search)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--swap-parent", default=None, help="where the swap directory is created (default $TMPDIR)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    st = Strata(library_path(args.lib))
    lib = st.lib
    seq_len, batch = 32, 4
    rng = random.Random(1234)
    corpus = make_corpus(1 << 16, rng)
    n_train = len(corpus) * 9 // 10
    train, validation = corpus[:n_train], corpus[n_train:]
    val_tokens = (ctypes.c_int32 * len(validation))(*validation)

    swap_dir = tempfile.mkdtemp(prefix="train_py-swap-", dir=args.swap_parent)
    device, engine = ctypes.c_void_p(), ctypes.c_void_p()
    try:
        ds = DeviceSettings()
        lib.strata_device_settings_init(ctypes.byref(ds))
        ds.memory_bytes = 256 << 20
        ds.pinned_bytes = 64 << 20
        st.check("strata_device_create", lib.strata_device_create(ctypes.byref(ds), ctypes.byref(device)))

        es = EngineSettings()
        lib.strata_engine_settings_init(ctypes.byref(es))
        es.n_layer, es.n_embd, es.n_head, es.vocab_size = 2, 128, 4, 256
        es.seq_len, es.micro_batch = seq_len, batch
        es.lr, es.warmup_steps, es.total_steps = 3e-3, 2 if args.steps > 2 else 0, args.steps
        es.params_tier, es.optimizer_tier = b"nvme", b"host"
        es.nvme_path = swap_dir.encode()
        st.check("strata_engine_create",
                 lib.strata_engine_create(device, ctypes.byref(es), None, ctypes.byref(engine)))
        stats = Stats()
        st.check("strata_engine_get_stats", lib.strata_engine_get_stats(engine, ctypes.byref(stats)))
        print(f"train.py: Strata {st.version()}, params on nvme, optimizer on host; plan: device "
              f"{stats.plan_device_bytes}, host {stats.plan_host_bytes}, nvme {stats.plan_nvme_bytes} bytes "
              f"(swap in {swap_dir})")

        before, after = EvalResult(), EvalResult()
        st.check("strata_engine_evaluate", lib.strata_engine_evaluate(engine, val_tokens, len(validation), 16,
                                                                      ctypes.byref(before)))
        n = batch * seq_len
        inputs, targets = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)()
        result = StepResult()
        for _ in range(args.steps):
            for b in range(batch):
                start = rng.randrange(n_train - seq_len - 1)
                inputs[b * seq_len:(b + 1) * seq_len] = list(train[start:start + seq_len])
                targets[b * seq_len:(b + 1) * seq_len] = list(train[start + 1:start + seq_len + 1])
            st.check("strata_engine_step", lib.strata_engine_step(engine, inputs, targets, n, ctypes.byref(result)))
            st.check("strata_engine_get_stats", lib.strata_engine_get_stats(engine, ctypes.byref(stats)))
            print(f"step {result.step} loss {result.loss:.4f} grad_norm {result.grad_norm:.3f} lr {result.lr:.2e} "
                  f"nvme_read {stats.bytes_nvme_read} prefetch_hit_rate {stats.prefetch_hit_rate:.2f}")
        st.check("strata_engine_evaluate", lib.strata_engine_evaluate(engine, val_tokens, len(validation), 16,
                                                                      ctypes.byref(after)))
        print(f"validation loss {before.loss:.4f} -> {after.loss:.4f} over {after.tokens} tokens")
        print(f"traffic: host->device {stats.bytes_h2d}, device->host {stats.bytes_d2h}, nvme read "
              f"{stats.bytes_nvme_read}, nvme written {stats.bytes_nvme_written} bytes")
    except StrataError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1
    finally:
        lib.strata_engine_destroy(engine)
        if device:
            st.check("strata_device_destroy", lib.strata_device_destroy(device))
        shutil.rmtree(swap_dir, ignore_errors=True)  # the engine's swap files and the directory
    return 0


if __name__ == "__main__":
    sys.exit(main())
