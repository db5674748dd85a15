#!/usr/bin/env bash
# Installs the build into a scratch prefix, then builds one of the embedding examples against the
# installed package (find_package(Strata)), or for `python` loads the installed libstrata.so
# through ctypes, and runs it. Passes only when the program succeeds, its last step's loss is
# below 80% of its first step's, parameters really went through NVMe, and it removed its swap
# directory.
#   install_embed.sh BUILD_DIR SOURCE_DIR c_train|embed_engine|python STEPS [PYTHON]
set -euo pipefail
build_dir="$1"
source_dir="$2"
example="$3"
steps="$4"
python="${5:-python3}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
mkdir "$scratch/tmp"
export TMPDIR="$scratch/tmp"  # the examples make their swap directories here
case "$example" in
  c_train | embed_engine)
    cmake -S "$source_dir/examples/$example" -B "$scratch/example" -G Ninja \
      -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
    cmake --build "$scratch/example" >/dev/null
    "$scratch/example/$example" "$steps" >"$scratch/out.txt"
    ;;
  python)
    lib="$(find "$scratch/prefix" -name 'libstrata.so' | head -n 1)"
    [ -n "$lib" ] || { echo "no libstrata.so under the install prefix" >&2; exit 1; }
    "$python" "$source_dir/examples/python/train.py" --lib "$lib" --steps "$steps" >"$scratch/out.txt"
    ;;
  *)
    echo "install_embed.sh: unknown example '$example'" >&2
    exit 2
    ;;
esac
cat "$scratch/out.txt"
# "step N loss X ...": compare the first and the last step's loss.
awk -v steps="$steps" '
  $1 == "step" && $3 == "loss" { if (n == 0) first = $4; last = $4; n++ }
  match($0, /nvme read \+?[0-9.]+/) { v = substr($0, RSTART, RLENGTH); sub(/nvme read \+?/, "", v); nvme = v }
  END {
    if (n != steps) { printf "expected %d step lines, found %d\n", steps, n; exit 1 }
    if (!(last < 0.8 * first)) { printf "loss did not fall: first %s, last %s (needs < 80%% of first)\n", first, last; exit 1 }
    if (!(nvme > 0)) { print "no NVMe read traffic reported: the parameters did not move through NVMe"; exit 1 }
    printf "ok: loss %s -> %s over %d steps, %s read from NVMe\n", first, last, n, nvme
  }' "$scratch/out.txt"
leftover="$(ls -A "$scratch/tmp")"
if [ -n "$leftover" ]; then
  echo "the example left files in its temporary directory: $leftover" >&2
  exit 1
fi
