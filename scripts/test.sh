#!/usr/bin/env bash
# The whole test suite: install, lint, type-check, then pytest (GPU tests skip without CUDA).
#   bash scripts/test.sh [--under-load [N]] [pytest args...]
# --under-load runs everything with N (default 2) CPU-bound processes spinning beside it, as
# on a machine that is doing other work: the suite must pass there too.
set -euo pipefail
cd "$(dirname "$0")/.."
spinners=0
if [ "${1:-}" = "--under-load" ]; then
  shift
  spinners=2
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    spinners=$1
    shift
  fi
fi
bash scripts/bootstrap.sh
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
.venv/bin/mypy
.venv/bin/pytest -q "$@"
