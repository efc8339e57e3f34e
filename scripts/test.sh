#!/usr/bin/env bash
# The whole test suite: install, lint, type-check, then pytest (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check src tests
.venv/bin/mypy
exec .venv/bin/pytest -q "$@"
