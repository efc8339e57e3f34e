#!/usr/bin/env bash
# The whole test suite: install, lint, type-check, then pytest in two processes (GPU tests
# skip without CUDA).
#   bash scripts/test.sh [--fast] [--under-load [N]] [pytest args...]
# --fast runs the unit tier alone (tests/unit: pure and in-process, a few minutes on two
# cores; docs/benchmarks.md has the figure), after the same lint and type-check; it installs
# only where .venv does not exist yet, so that an edit-and-test loop does not wait for pip.
# --under-load runs everything with N (default 2) CPU-bound processes spinning beside it, as
# on a machine that is doing other work: the suite must pass there too.
set -euo pipefail
cd "$(dirname "$0")/.."
spinners=0
fast=0
while [ $# -gt 0 ]; do
  case "$1" in
    --fast)
      fast=1
      shift
      ;;
    --under-load)
      shift
      spinners=2
      if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
        spinners=$1
        shift
      fi
      ;;
    *) break ;;
  esac
done
if [ "$fast" -eq 0 ] || [ ! -x .venv/bin/python ]; then
  bash scripts/bootstrap.sh
fi
pids=()
stop_spinners() {
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
}
trap stop_spinners EXIT
for _ in $(seq 1 "$spinners"); do
  # At the suite's own priority: a niced spinner would only take idle time.
  bash -c 'while :; do :; done' &
  pids+=($!)
done
if [ "$spinners" -gt 0 ]; then
  echo "test.sh: $spinners CPU-bound processes spin while the suite runs"
fi
.venv/bin/ruff check src tests
# mypy (a minute or more from a fresh clone) runs beside pytest rather than before it, on
# the CPU pytest leaves idle while it waits on servers and subprocesses. Its verdict counts
# as much as pytest's; its output comes after pytest's.
mypy_log=$(mktemp)
.venv/bin/mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
pids+=("$mypy_pid")
rc=0
if [ "$fast" -eq 1 ]; then
  .venv/bin/pytest -q tests/unit "$@" || rc=$?
else
  # Two pytest processes (HICACHE_TEST_WORKERS; 0: one), each taking the next test module
  # as it finishes one: on CI's two cores one runs while the other waits on a server's
  # start, a subprocess or a socket. Whole modules, so that a module's servers and
  # conversions are made once (split across both they were made twice: 30-45 s each); the
  # slow end-to-end modules come first in collection order, the short unit ones last. The
  # slowest tests at the end of the log: the run must stay within CI's 30 minutes.
  .venv/bin/pytest -q -n "${HICACHE_TEST_WORKERS:-2}" --dist loadscope --durations=25 "$@" \
    || rc=$?
fi
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_log"
rm -f "$mypy_log"
if [ "$mypy_rc" -ne 0 ]; then
  echo "test.sh: mypy failed (exit $mypy_rc)"
  [ "$rc" -ne 0 ] || rc=$mypy_rc
fi
exit "$rc"
