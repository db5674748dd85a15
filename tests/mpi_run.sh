#!/usr/bin/env bash
# Runs a test program on NP real MPI processes and judges the whole job (ctest's `dist` tests).
#
#   mpi_run.sh [options] NP PROGRAM [ARGS...]
#     --env NAME=VALUE     export to every rank (STRATA_* names are kept by the test harness)
#     --mca NAME VALUE     an OpenMPI MCA parameter for this run
#     --limit SECONDS      the job must end within this (default 120); a hang fails the test
#     --expect-failure     the job must end with a non-zero status (a rank failed or was killed)
#     --expect REGEX:N     the output must match REGEX on at least N lines (repeatable)
#
# Without --expect-failure the job must exit 0 and every rank must report its gtest run passed.
# Either way no rank may report a failed gtest assertion.
set -uo pipefail

envs=()
mcas=()
expects=()
limit=120
expect_failure=0
while [ $# -gt 0 ]; do
  case "$1" in
    --env) envs+=("$2"); shift 2 ;;
    --mca) mcas+=(--mca "$2" "$3"); shift 3 ;;
    --limit) limit="$2"; shift 2 ;;
    --expect-failure) expect_failure=1; shift ;;
    --expect) expects+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "usage: mpi_run.sh [options] NP PROGRAM [ARGS...]" >&2
  exit 2
fi
np="$1"
shift

# No colour codes: the output is matched line by line below.
launcher=(mpirun --oversubscribe -np "$np" -x GTEST_COLOR=no)
# OpenMPI refuses to run as root unless told; only say so when it applies.
if [ "$(id -u)" = 0 ]; then launcher+=(--allow-run-as-root); fi
keep=""
for kv in "${envs[@]}"; do
  launcher+=(-x "$kv")
  keep="${keep:+$keep,}${kv%%=*}"
done
if [ -n "$keep" ]; then launcher+=(-x "STRATA_TEST_KEEP=$keep"); fi
launcher+=("${mcas[@]}")

log="$(mktemp)"
# Every rank's temporary files (TempDir, swap directories, OpenMPI's session directory) go under
# one directory of this job, removed when it ends: a rank that is killed or aborts (the failure
# tests do that on purpose) runs no destructor and would leave its files in /tmp.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/strata-dist-XXXXXX")"
trap 'rm -f "$log"; rm -rf "$scratch"' EXIT
launcher+=(-x "TMPDIR=$scratch")
echo "+ ${launcher[*]} $*"
start=$SECONDS
timeout --kill-after=10 "$limit" "${launcher[@]}" "$@" >"$log" 2>&1
rc=$?
elapsed=$((SECONDS - start))
cat "$log"

fail() {
  echo "mpi_run.sh: FAIL: $*" >&2
  exit 1
}
# timeout(1) exits 124 (or 137 after its KILL); mpirun itself exits 137 when a rank died of
# SIGKILL, so the elapsed time tells the two apart.
if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ "$elapsed" -ge "$limit" ]; }; then
  fail "the job did not end within ${limit} s (a rank hangs)"
fi
if grep -q '^\[  FAILED  \]' "$log"; then fail "a rank reported a failed test"; fi
if [ "$expect_failure" = 1 ]; then
  [ "$rc" != 0 ] || fail "the job exited 0, expected a failure"
else
  [ "$rc" = 0 ] || fail "the job exited with status $rc"
  passed="$(grep -c '^\[  PASSED  \]' "$log")"
  [ "$passed" = "$np" ] || fail "$passed of $np ranks reported their tests passed"
fi
for e in "${expects[@]}"; do
  regex="${e%:*}"
  want="${e##*:}"
  got="$(grep -cE -- "$regex" "$log")"
  [ "$got" -ge "$want" ] || fail "'$regex' appears on $got lines, expected at least $want"
done
echo "mpi_run.sh: OK (status $rc after ${elapsed} s)"
