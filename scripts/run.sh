#!/usr/bin/env bash
# The main job: install, then `hicache serve` with the embedded defaults (SmolLM2-135M-Instruct,
# converted once from its GGUF into ~/.cache/hicache/models; L1 + L2 + the file L3 under
# ~/.cache/hicache/l3; on 127.0.0.1:30000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/hicache serve "$@"
