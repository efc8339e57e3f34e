"""The CPU paged decode kernel: built once per machine with g++, called through ctypes.

torch has no CPU attention that reads a paged pool in place, and gathering every
sequence's context into a padded tensor per layer per step costs as much as the
attention itself on long contexts. ``cpu_paged_attention.cpp`` walks each context
through its page table instead. It is compiled at first use (about a second:
it needs no torch headers) with ``-march=native`` into
``$HICACHE_CACHE_DIR/kernels/``, under a name that hashes the source, the flags,
the compiler and this CPU, so a changed source or another machine rebuilds.

``load_cpu_kernel()`` returns None (and says why in the log, once) where no C++
compiler works: the engine then falls back to the gathering path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hicache.local_cache import local_cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_ABI_VERSION = 1
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_COMPILE_TIMEOUT_S = 120.0
DISABLE_ENV = "HICACHE_DISABLE_CPU_KERNEL"


class CpuKernelError(RuntimeError):
    """The CPU kernel was called with tensors it does not take."""


class _Loaded:
    lock = threading.Lock()
    tried = False
    library: ctypes.CDLL | None = None
    reason: str | None = None


def cpu_kernel_unavailable_reason() -> str | None:
    """None when the kernel is (or can be) loaded; else why not."""
    load_cpu_kernel()
    return _Loaded.reason


def load_cpu_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be."""
    with _Loaded.lock:
        if not _Loaded.tried:
            _Loaded.tried = True
            try:
                _Loaded.library = _load()
            except (OSError, subprocess.SubprocessError, CpuKernelError) as error:
                _Loaded.reason = str(error)
                logger.warning(
                    "CPU paged attention kernel unavailable (%s): decode attention gathers "
                    "each context instead", error,
                )
        return _Loaded.library


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        raise CpuKernelError(f"{DISABLE_ENV} is set")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise CpuKernelError("no C++ compiler (g++) found")
    path = _library_path(compiler)
    if not path.exists():
        _compile(compiler, path)
    library = ctypes.CDLL(str(path))
    if library.hicache_kernel_abi_version() != _ABI_VERSION:
        raise CpuKernelError(f"{path} has another ABI version")
    fn = library.hicache_paged_decode
    fn.restype = ctypes.c_int
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [
        i32, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr,
        i32, i32, i32, i32, i32, ctypes.c_float, i32,
    ]
    return library


def _library_path(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(),
                 _cpu_signature().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return local_cache_dir() / "kernels" / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent builders never load half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, str(_SOURCE)],
            capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False,
        )
        if done.returncode != 0:
            raise CpuKernelError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [B, heads, D] of one query per sequence over its paged context.

    q: [B, heads, D]; k_cache, v_cache: [slots, kv_heads, D] (one layer of the pool);
    page_table: int32 [B, >= pages of the longest context]; seq_lens: int32 [B], each >= 1.
    The last dimension of q and the caches must be contiguous.
    """
    library = load_cpu_kernel()
    if library is None:
        raise CpuKernelError(f"the CPU kernel is unavailable: {_Loaded.reason}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    code = _DTYPE_CODES.get(q.dtype)
    if code is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise CpuKernelError(f"dtypes {q.dtype}/{k_cache.dtype} are not supported")
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise CpuKernelError("the CPU kernel takes CPU tensors")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise CpuKernelError("the head dimension must be contiguous")
    if k_cache.stride() != v_cache.stride() or num_heads % num_kv_heads:
        raise CpuKernelError("k and v caches must match, and kv heads divide heads")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise CpuKernelError("page_table and seq_lens must be int32")
    if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise CpuKernelError("page_table rows and seq_lens must be contiguous")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs == 0:
        return out
    status = library.hicache_paged_decode(
        code, q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, page_size,
        scale if scale is not None else head_dim**-0.5, torch.get_num_threads(),
    )
    if status != 0:
        raise CpuKernelError(f"the CPU kernel failed with status {status}")
    return out
