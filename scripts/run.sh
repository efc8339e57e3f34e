#!/usr/bin/env bash
# The main job: install, then `hicache serve` with the embedded defaults (dummy weights of the
# tiny preset, L1 + L2 + the file L3 under ~/.cache/hicache/l3, on 127.0.0.1:30000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/hicache serve "$@"
