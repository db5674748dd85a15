#!/usr/bin/env python3
"""The step of 7B-175B models on GPU machines that are not this one (strata plan --profile).

For each model and machine, every placement that fits is predicted by strata plan's step-time
model from the machine's datasheet rates (tools/strata/profiles.cpp); this prints, per model and
machine, the fastest placement and its step, GPU utilisation (the fraction of the step the GPU
computes) and model TFLOPS, and the same for the fastest placement of each kind.

usage: bench/simulate_offload.py [--strata PATH] [--tokens-per-step N] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys

# LLaMA 2 7B / 13B / 70B and GPT-3 175B (Hugging Face config shapes).
MODELS = [
    ("7B", "--model llama --layers 32 --width 4096 --heads 32 --ffn 11008 --vocab-size 32000"),
    ("13B", "--model llama --layers 40 --width 5120 --heads 40 --ffn 13824 --vocab-size 32000"),
    ("70B", "--model llama --layers 80 --width 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab-size 32000"),
    ("175B", "--model gpt2 --layers 96 --width 12288 --heads 96 --vocab-size 50257"),
]
MACHINES = [
    ("H100, PCIe 4, 1 NVMe", "--profile h100 --host-link pcie4 --nvme-drives 1"),
    ("H100, PCIe 5, 4 NVMe", "--profile h100 --host-link pcie5 --nvme-drives 4"),
    ("H200, PCIe 5, 4 NVMe", "--profile h200 --host-link pcie5 --nvme-drives 4"),
]
KINDS = [
    ("optimizer on host", lambda r: r["offload_param"] == "device" and r["offload_optimizer"] == "host"),
    ("params + optimizer on host", lambda r: r["offload_param"] == "host" and r["offload_optimizer"] == "host"),
    ("params on NVMe, optimizer on host", lambda r: r["offload_param"] == "nvme" and r["offload_optimizer"] == "host"),
    ("optimizer on NVMe", lambda r: r["offload_optimizer"] == "nvme"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--strata", default=os.path.join(here, "..", "build", "bin", "strata"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--host-memory", default="1TiB")
    ap.add_argument("--cpu-cores", type=int, default=64)
    ap.add_argument("--host-bandwidth", type=float, default=300)
    ap.add_argument("--json", help="also write every prediction here")
    a = ap.parse_args()
    common = (f"--dtype bf16 --checkpointing on --seq-len {a.seq_len} --batch {a.batch} "
              f"--grad-accum {a.grad_accum} --host-memory {a.host_memory} --cpu-cores {a.cpu_cores} "
              f"--host-bandwidth {a.host_bandwidth}")
    out = []
    print(f"tokens per step {a.batch * a.grad_accum * a.seq_len} ({a.grad_accum} x {a.batch} x {a.seq_len}), "
          f"bf16, activation checkpointing; {a.cpu_cores} cores, {a.host_bandwidth:g} GB/s host memory, "
          f"{a.host_memory} host memory\n")
    print("| model | machine | fastest placement | step s | GPU util | TFLOPS | "
          + " | ".join(k for k, _ in KINDS) + " |")
    print("| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in KINDS) + " |")
    for mname, mflags in MODELS:
        for hname, hflags in MACHINES:
            cmd = [a.strata, "plan", "--json"] + mflags.split() + hflags.split() + common.split()
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"| {mname} | {hname} | does not fit: {r.stderr.strip().splitlines()[0]} |")
                continue
            j = json.loads(r.stdout)
            out.append({"model": mname, "machine": hname, "plan": j})
            c = j["chosen"]
            cells = []
            for _, pick in KINDS:
                rows = [x for x in j["placements"] if pick(x)]
                if rows:
                    best = min(rows, key=lambda x: x["predicted"]["step_s"])
                    cells.append(f'{best["predicted"]["step_s"]:.2f} s, {100 * best["gpu_utilization"]:.0f}%')
                else:
                    cells.append("does not fit")
            print(f'| {mname} | {hname} | {c["placement"]} | {c["predicted"]["step_s"]:.2f} | '
                  f'{100 * c["gpu_utilization"]:.0f}% | {c["model_tflops"]:.0f} | ' + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
