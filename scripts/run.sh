#!/usr/bin/env bash
# The main job: install, then run hicache (the L1 -> L2 -> L1 demo until `hicache serve` lands).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/hicache demo "$@"
