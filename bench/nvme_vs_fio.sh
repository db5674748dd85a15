#!/usr/bin/env bash
# Strata's NVMe engine against fio on the same file system, interleaved.
#
# Each round runs, in a rotating order: fio (ioengine=io_uring, direct=1) without and with
# fixedbufs+registerfiles, and `strata bench nvme` with checksums off and on (its pinned window
# on transparent huge pages, as Strata allocates it) and with checksums off on ordinary 4 KiB
# pages (the same kind of memory fio uses: the engine alone against fio); every variant
# writes SIZE bytes to a fresh file and reads them back with the same block size and queue
# depth. Virtual disks vary 2-3x from one minute to the next, so only figures taken side by
# side mean anything: the script prints the median of each figure over the rounds and the
# ratios of those medians.
#
# usage: bench/nvme_vs_fio.sh [--path DIR] [--size BYTES] [--block-size BYTES] [--queue-depth N]
#                             [--rounds N] [--strata PATH] [--json FILE]
# Needs fio and python3 (both Debian packages). Sizes take fio-style suffixes (1M, 2G).
set -euo pipefail

path=/tmp
size=1G
bs=1M
qd=16
rounds=5
strata=""
json_out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --path) path="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --block-size) bs="$2"; shift 2 ;;
    --queue-depth) qd="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --strata) strata="$2"; shift 2 ;;
    --json) json_out="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "nvme_vs_fio.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "$strata" ]]; then
  for c in "$here/../build/bin/strata" "$(command -v strata || true)"; do
    if [[ -n "$c" && -x "$c" ]]; then strata="$c"; break; fi
  done
fi
[[ -x "$strata" ]] || { echo "nvme_vs_fio.sh: strata binary not found (build it or pass --strata)" >&2; exit 2; }
command -v fio >/dev/null || { echo "nvme_vs_fio.sh: fio not found (apt-get install fio)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "nvme_vs_fio.sh: python3 not found" >&2; exit 2; }

to_bytes() {  # 1M, 1MiB, 4096, 2G -> bytes (binary units, like fio)
  python3 -c '
import re, sys
m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", sys.argv[1])
if not m: sys.exit("not a size: " + sys.argv[1])
print(int(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))' "$1"
}
size_b=$(to_bytes "$size")
bs_b=$(to_bytes "$bs")

work="$path/strata-nvme-vs-fio-$$"
mkdir -p "$work"
results="$work/results.jsonl"
trap 'rm -rf "$work"' EXIT

# One fio phase; prints {"gbps": .., "cpu_s": ..} from fio's own accounting of the job.
fio_phase() {  # rw extra-args...
  local rw="$1"; shift
  fio --name=strata-cmp --filename="$work/fio.data" --size="$size_b" --bs="$bs_b" --iodepth="$qd" \
      --ioengine=io_uring --direct=1 --rw="$rw" --numjobs=1 --output-format=json "$@" |
    python3 -c '
import json, sys
job = json.load(sys.stdin)["jobs"][0]
side = job["write" if sys.argv[1] == "write" else "read"]
cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
print(json.dumps({"gbps": side["bw_bytes"] / 1e9, "cpu_s": cpu_s}))' "$rw"
}

run_fio() {  # variant extra-args...
  local variant="$1"; shift
  rm -f "$work/fio.data"
  local w r
  w=$(fio_phase write "$@")
  r=$(fio_phase read "$@")
  rm -f "$work/fio.data"
  python3 -c '
import json, sys
w, r = json.loads(sys.argv[2]), json.loads(sys.argv[3])
gb = int(sys.argv[4]) / 1e9
print(json.dumps({"variant": sys.argv[1], "write_gbps": w["gbps"], "read_gbps": r["gbps"],
                  "cpu_s_per_gb": (w["cpu_s"] + r["cpu_s"]) / (2 * gb)}))' "$variant" "$w" "$r" "$size_b" >>"$results"
}

run_strata() {  # variant verify(on|off) hugepages(on|off)
  "$strata" bench nvme --json --path "$work" --size "$size_b" --block-size "$bs_b" --queue-depth "$qd" \
      --verify "$2" --hugepages "$3" |
    python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["data_ok"] and j["direct"], j
print(json.dumps({"variant": sys.argv[1], "write_gbps": j["write_gbps"], "read_gbps": j["read_gbps"],
                  "cpu_s_per_gb": j["cpu_s_per_gb"], "backend": j["backend"]}))' "$1" >>"$results"
}

variants=(fio fio_fixed strata strata_verify strata_4k)
run_variant() {
  case "$1" in
    fio) run_fio fio ;;
    fio_fixed) run_fio fio_fixed --fixedbufs --registerfiles ;;
    strata) run_strata strata off on ;;
    strata_verify) run_strata strata_verify on on ;;
    strata_4k) run_strata strata_4k off off ;;
  esac
}

echo "nvme_vs_fio: $(date -u +%Y-%m-%dT%H:%MZ) path=$path ($(df -T "$path" | awk 'NR==2{print $2}')) size=$size_b" \
     "block=$bs_b qd=$qd rounds=$rounds kernel=$(uname -r)"
for ((round = 0; round < rounds; round++)); do
  for ((k = 0; k < ${#variants[@]}; k++)); do
    v=${variants[$(((k + round) % ${#variants[@]}))]}
    run_variant "$v"
    tail -n1 "$results" | sed "s/^/  round $((round + 1)): /"
  done
done

python3 - "$results" "$json_out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = {}
for v in ("fio", "fio_fixed", "strata", "strata_verify", "strata_4k"):
    rs = [r for r in rows if r["variant"] == v]
    med[v] = {k: statistics.median(r[k] for r in rs) for k in ("write_gbps", "read_gbps", "cpu_s_per_gb")}
print("\nmedians over %d rounds:" % len([r for r in rows if r["variant"] == "fio"]))
print("  %-14s %10s %10s %14s" % ("variant", "write GB/s", "read GB/s", "CPU s per GB"))
for v, m in med.items():
    print("  %-14s %10.3f %10.3f %14.4f" % (v, m["write_gbps"], m["read_gbps"], m["cpu_s_per_gb"]))
best_w = max(med["fio"]["write_gbps"], med["fio_fixed"]["write_gbps"])
best_r = max(med["fio"]["read_gbps"], med["fio_fixed"]["read_gbps"])
ratios = {
    "write_vs_fio": med["strata"]["write_gbps"] / med["fio"]["write_gbps"],
    "write_vs_fio_fixed": med["strata"]["write_gbps"] / med["fio_fixed"]["write_gbps"],
    "read_vs_fio": med["strata"]["read_gbps"] / med["fio"]["read_gbps"],
    "read_vs_fio_fixed": med["strata"]["read_gbps"] / med["fio_fixed"]["read_gbps"],
    "write_vs_best_fio": med["strata"]["write_gbps"] / best_w,
    "read_vs_best_fio": med["strata"]["read_gbps"] / best_r,
    "write_4k_vs_best_fio": med["strata_4k"]["write_gbps"] / best_w,
    "read_4k_vs_best_fio": med["strata_4k"]["read_gbps"] / best_r,
    "cpu_vs_fio_fixed": med["strata"]["cpu_s_per_gb"] / med["fio_fixed"]["cpu_s_per_gb"],
    "cpu_4k_vs_fio_fixed": med["strata_4k"]["cpu_s_per_gb"] / med["fio_fixed"]["cpu_s_per_gb"],
    "verify_cpu_vs_fio_fixed": med["strata_verify"]["cpu_s_per_gb"] / med["fio_fixed"]["cpu_s_per_gb"],
    "read_verify_vs_no_verify": med["strata_verify"]["read_gbps"] / med["strata"]["read_gbps"],
    "write_verify_vs_no_verify": med["strata_verify"]["write_gbps"] / med["strata"]["write_gbps"],
}
targets = {"write_vs_best_fio": (">=", 0.95), "read_vs_best_fio": (">=", 0.95),
           "cpu_vs_fio_fixed": ("<=", 1.0), "read_verify_vs_no_verify": (">=", 0.9)}
print("\nratios of medians:")
for k, v in ratios.items():
    t = targets.get(k)
    verdict = ""
    if t:
        ok = v >= t[1] if t[0] == ">=" else v <= t[1]
        verdict = "  target %s %.2f: %s" % (t[0], t[1], "met" if ok else "MISSED")
    print("  %-26s %6.3f%s" % (k, v, verdict))
if sys.argv[2]:
    json.dump({"medians": med, "ratios": ratios, "rounds": rows}, open(sys.argv[2], "w"), indent=2)
EOF
