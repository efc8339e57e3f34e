#!/usr/bin/env bash
# GPU check: the unit + GPU test suites, then the benchmarks that need a GPU (transfer, cold
# prefill vs transformers, full-L2-hit TTFT vs its bound); logs and JSON go to $OUT.
# Run from anywhere on a CUDA machine with torch + triton + pytest installed (no network needed):
#   OUT=/path/to/out bash scripts/gpu_check.sh
# What the machine lacks (the HTTP server's packages, Mooncake) comes from .whl/ when
# scripts/wheelhouse.sh filled it: installed into a private folder, put first on PYTHONPATH.
# Every step runs even if an earlier one fails; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT"
export PYTHONPATH=src
PY=${PYTHON:-python3}
status=0

if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${SITE:-/tmp/hicache-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="src:$SITE" PATH="$SITE/bin:$PATH"
fi
if compgen -G ".whl/deb/*.deb" > /dev/null; then
  SYSROOT=${SYSROOT:-/tmp/hicache-sysroot}
  for deb in .whl/deb/*.deb; do dpkg -x "$deb" "$SYSROOT"; done
  export LD_LIBRARY_PATH="$SYSROOT/usr/lib/x86_64-linux-gnu:$SYSROOT/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

STEPS=${STEPS:-}

run() {  # run NAME TIMEOUT_S CMD...: tee output to $OUT/NAME.log, remember a failure
  local name=$1 limit=$2
  shift 2
  # LIMIT_<name>=S shortens (or lengthens) one step's limit, to fit several steps in one call.
  local override="LIMIT_$name"
  limit=${!override:-$limit}
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  echo "=== $name: $*" | tee "$OUT/$name.log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
  if [ "$rc" -ne 0 ]; then status=1; fi
}

# Fails (and so flags the run) when CUDA is missing: the GPU tests would only skip.
run env 60 "$PY" -c "import sys, torch, triton, transformers, fastapi; print(sys.version); \
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'fastapi', fastapi.__version__); \
assert torch.cuda.is_available(), 'CUDA is not available'; print(torch.cuda.get_device_name(0))"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# Budget (worst case, each step is killed at its limit): 60 + 540 + 3 x 120 + 2 x 40 + 2 x 240
# + 300 + 120 + 60 + 4 x 570 s; one device call allows 10 min, so split it with STEPS:
#   STEPS="env pytest"    STEPS="env bench_transfer bench_attention bench_direct_dma bench_direct_gather"
#   STEPS="env bench_transfer_mla"
#   STEPS="env bench_prefill bench_l2_ttft bench_load_vs_recompute"    STEPS="env compare_llama"
#   STEPS="env bench_storage bench_storage_sealed compare_qwen"    STEPS="env compare_cuda_graph"
#   STEPS="env compare_qwen_l3 bench_page_hash" (about 2.5 minutes)
# (default: every step); LIMIT_<step>=S sets one step's limit in seconds. The benchmarks write their JSON as they go.
# The GPU tests (and the model tests with CUDA cases); -rA lists every outcome, so a run cut
# short by its limit still says what passed. The CPU unit suite runs in CI, not here.
# PYTEST_PATHS narrows it (say, to tests/gpu alone when the call is short).
read -r -a pytest_paths <<< "${PYTEST_PATHS:-tests/gpu tests/unit/model tests/integration/model tests/e2e/model}"
run pytest 540 "$PY" -m pytest -q -rA -p no:cacheprovider "${pytest_paths[@]}"
run bench_transfer 120 "$PY" -m hicache bench transfer --json "$OUT/transfer.json"
# MLA pages (one 576-element latent per layer, a quarter of Llama's bytes): more blocks per GB.
run bench_transfer_mla 120 "$PY" -m hicache bench transfer --geometry deepseek-v2-lite \
  --json "$OUT/transfer_mla.json"
# Attention backends per layer (gather reference, triton, flashinfer when installed): decode at
# B=1..256 and contexts 1K..8K, prefix extends and a cold 4K prefill (two sequences each),
# Llama-3-8B heads (32 q / 8 kv, D=128), bf16.
run bench_attention 120 "$PY" -m hicache bench attention --device cuda --dtype bfloat16 \
  --heads 32 --kv-heads 8 --head-dim 128 --cases 1x8192x1 8x4096x1 32x2048x1 64x2048x1 \
  256x1024x1 1x4096x512 2x0x4096 2x3072x1024 2x8192x256 --json "$OUT/attention.json"
# The direct backend's DMA-vs-CPU-gather threshold for loads, both extremes, to tune its default.
run bench_direct_dma 40 "$PY" -m hicache bench transfer --backends direct --repeats 3 \
  --direct-min-dma-bytes 0 --json "$OUT/transfer_direct_dma.json"
run bench_direct_gather 40 "$PY" -m hicache bench transfer --backends direct --repeats 3 \
  --direct-min-dma-bytes 1099511627776 --json "$OUT/transfer_direct_gather.json"
# Cold prefill against transformers (sdpa) on the same llama3-8b dummy weights (issue: engine).
run bench_prefill 240 "$PY" -m hicache bench prefill --json "$OUT/prefill.json"
# TTFT of a whole-prefix L2 hit next to KV bytes / pinned H2D bandwidth + suffix compute.
run bench_l2_ttft 240 "$PY" -m hicache bench l2-ttft --model-preset llama3-8b \
  --hicache-mem-layout page_first --json "$OUT/l2_ttft.json"
# Loading a cached prompt against computing it again (issue 31): a full L3 hit through a store
# throttled from unlimited down to 500 MB/s, half in L2 and all in L3 (--mixed), and a full L2
# hit, each next to the same prompt recomputed cold and to the engine's own choice, Llama-3-8B
# dummy bf16 weights (the baseline without the choice and mixed rows: 83 s on an H200).
# LVR_POINTS narrows the sweep to fit a short call.
read -r -a lvr_points <<< "${LVR_POINTS:-2:none 2:8GB 2:2GB 2:500MB}"
run bench_load_vs_recompute 300 "$PY" -m hicache bench load-vs-recompute --model-preset llama3-8b \
  --device cuda --tokens 4096 16384 --points "${lvr_points[@]}" --mixed --repeats 2 \
  --json "$OUT/load_vs_recompute.json"
# L3 backends next to their plain baselines on a host with cores and memory bandwidth to spare
# (mooncake is reported as skipped when its client is not installed there).
run bench_storage 120 "$PY" -m hicache bench storage --backends file,mooncake \
  --json "$OUT/storage.json"
# The same with every page sealed (AES-256-GCM, one random key per tenant) next to plain: what
# encryption at rest costs where cores are to spare (issue 32's target is for the CPU machine).
run bench_storage_sealed 120 "$PY" -m hicache bench storage --backends file,mooncake \
  --encryption-keys random --json "$OUT/storage_sealed.json"

# The comparison driver (no cache, L1, L1+L2, L1+L2+L3 file and Mooncake), one device call each.
# Its many files (summaries, request logs, server logs, table, plot) come back as one archive.
compare() {  # compare NAME ARGS...: run `hicache bench compare`, archive its folder in $OUT
  local name=$1
  shift
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local dir=${WORK:-/tmp/hicache-gpu-check}/$name
  rm -rf "$dir"
  run "$name" 570 "$PY" -m hicache bench compare --out-dir "$dir" --no-progress "$@"
  tar czf "$OUT/$name.tgz" -C "$(dirname "$dir")" "$name" 2>/dev/null || true
}
# The seeds' multi-turn shape on one GPU: 2K-token turns, one output token (to isolate prefill),
# contexts growing to 32K tokens (16 rounds: with 9 rounds even a perfect cache computes only
# 4.7x fewer FLOPs than none, so the 6x target needs the longer conversations); the device
# pool holds a quarter of the working set (34 GB of KV), the host pool all of it.
compare compare_llama --server-args "--model-preset llama3-8b --device cuda --hicache-ratio 5" \
  --working-set-ratio 4 --num-clients 6 --num-rounds 16 --request-length 2048 \
  --sub-question-length 2048 --output-length 1 --max-inflight 4
# A small model (transfers weigh more next to its compute), and a host pool of half the working
# set, so that turns come back from L3.
compare compare_qwen --server-args "--model-preset qwen3-0.6b --device cuda --hicache-ratio 2" \
  --working-set-ratio 4 --num-clients 12 --num-rounds 12 --request-length 2048 \
  --sub-question-length 2048 --output-length 1 --max-inflight 8 \
  --file-extra-config '{"max_bytes": "40GB"}' \
  --mooncake-extra-config '{"global_segment_size": "40GiB"}'
# What attaching the file L3 costs a GPU server next to L2 alone, shortened (74 s on an H200):
# the fifth lending measured 1.06x no-cache's input throughput with the file store against
# 1.55x without it, the L3 threads holding the GIL while they hashed pages; rerun since the
# page hash no longer holds it (docs/benchmarks.md).
compare compare_qwen_l3 --configs no-cache,l1-l2,l1-l2-l3-file \
  --server-args "--model-preset qwen3-0.6b --device cuda --hicache-ratio 2" \
  --working-set-ratio 4 --num-clients 8 --num-rounds 6 --request-length 2048 \
  --sub-question-length 2048 --output-length 1 --max-inflight 8 \
  --file-extra-config '{"max_bytes": "40GB"}'
# The page checksum beside a scheduler-like thread, on the GPU host's cores (seconds).
run bench_page_hash 60 "$PY" -m hicache bench page-hash --json "$OUT/page_hash.json"
# Decode recorded as CUDA graphs (the default) against eager decode (--disable-cuda-graph) in
# one invocation: a small model whose decode step is launch-bound, 4 clients decoding 256 tokens.
compare compare_cuda_graph --configs l1 \
  --server-args "--model-preset qwen3-0.6b --device cuda" \
  --baseline-name eager --baseline-api generate --baseline-model qwen3 \
  --baseline-command "$PY -m hicache serve --model-preset qwen3-0.6b --device cuda \
    --host {host} --port {port} --disable-hierarchical-cache --hicache-storage-backend none \
    --disable-cuda-graph" \
  --repeats 2 --num-clients 4 --num-rounds 2 --request-length 512 --sub-question-length 64 \
  --output-length 256 --max-inflight 4
exit $status
