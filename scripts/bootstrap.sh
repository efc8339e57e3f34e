#!/usr/bin/env bash
# Create .venv (once) and install hicache with its dev tools into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# torch first: a pinned release installs quickly where a wheel of it is cached;
# anywhere else, fall back to whatever torch pip resolves.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==${HICACHE_TORCH_VERSION:-2.13.0}" || .venv/bin/pip install -q torch
fi
.venv/bin/pip install -q -e ".[dev]"
