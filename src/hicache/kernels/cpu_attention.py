"""The CPU paged decode kernel: built once per machine with g++, called through ctypes.

torch has no CPU attention that reads a paged pool in place, and gathering every
sequence's context into a padded tensor per layer per step costs as much as the
attention itself on long contexts. ``cpu_paged_attention.cpp`` walks each context
through its page table instead. It is compiled at first use (about a second:
it needs no torch headers; ``kernels.cpu_build``).

``load_cpu_kernel()`` returns None (and says why in the log, once) where no C++
compiler works: the engine then falls back to the gathering path.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from hicache.kernels.cpu_build import CpuBuildError, build_and_load

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_ABI_VERSION = 1
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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
    try:
        library = build_and_load(_SOURCE, _FLAGS)
    except CpuBuildError as error:
        raise CpuKernelError(str(error)) from error
    if library.hicache_kernel_abi_version() != _ABI_VERSION:
        raise CpuKernelError(f"{library._name} has another ABI version")
    fn = library.hicache_paged_decode
    fn.restype = ctypes.c_int
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [
        i32, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr,
        i32, i32, i32, i32, i32, ctypes.c_float, i32,
    ]
    return library


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
