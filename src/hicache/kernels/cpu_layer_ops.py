"""One-pass float32 and bfloat16 CPU versions of a layer's elementwise ops
(``cpu_layer_ops.cpp``): RMSNorm, RoPE and SwiGLU's silu(gate) * up.

Each function returns None where it does not apply (another dtype or device, a
layout it does not take, inside ``torch.compile``, no compiler here), and the
caller then runs its torch version: these are a faster path, never the only one.
Measured on this project's CPU machine (one thread, SmolLM2-135M's shapes): RMSNorm of
4 rows 9.5 -> 4.2 us, of 84 rows 17.7 -> 8.4 us; RoPE of q and k 10.2 -> 5.6 us and
36.3 -> 9.1 us (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from hicache.kernels.cpu_build import CpuBuildError, LazyLibrary, build_and_load

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_layer_ops.cpp")
# -ffp-contract=off: no fused multiply-adds, so products round as torch's separate ops do.
# -fno-trapping-math lets silu's floor and clamps vectorize (no result changes: only the
# floating-point exception flags, which nothing reads).
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17")
_ABI_VERSION = 4
# Ops over fewer elements run on the calling thread alone: waking torch's OpenMP team
# (the library shares its runtime) costs more than the pass it would split.
PARALLEL_FROM_ELEMENTS = 1 << 16


def _unavailable(error: Exception) -> None:
    logger.warning("CPU layer ops unavailable (%s): torch's ops run instead", error)


def _library() -> ctypes.CDLL | None:
    return _LIBRARY.get()


def _load() -> ctypes.CDLL:
    library = build_and_load(_SOURCE, _FLAGS)
    if library.hicache_layer_ops_abi_version() != _ABI_VERSION:
        raise CpuBuildError(f"{library._name} has another ABI version")
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for norm in (library.hicache_rms_norm, library.hicache_rms_norm_bf16):
        norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32]
    for rotate in (library.hicache_rotary, library.hicache_rotary_bf16):
        rotate.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64, i32]
    for swiglu in (library.hicache_silu_mul, library.hicache_silu_mul_bf16):
        swiglu.argtypes = [ptr, i64, ptr, i64, i64, i32]
    for fn in (library.hicache_rms_norm, library.hicache_rms_norm_bf16, library.hicache_rotary,
               library.hicache_rotary_bf16, library.hicache_silu_mul,
               library.hicache_silu_mul_bf16):
        fn.restype = None
    return library


_LIBRARY = LazyLibrary(_load, (OSError, CpuBuildError), _unavailable)


_DTYPES = (torch.float32, torch.bfloat16)


def _usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, if the tensors are CPU tensors of one dtype it takes (float32 or
    bfloat16), outside torch.compile."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return None
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            return None
    if torch.compiler.is_compiling():
        return None
    return _library()


def _threads(elements: int) -> int:
    """Threads for an op over ``elements``: torch's count for large ones, else one."""
    return torch.get_num_threads() if elements >= PARALLEL_FROM_ELEMENTS else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of the rows of a 2-D ``x`` [rows, dim] (last dim contiguous); None: not here."""
    library = _usable(x, weight)
    if library is None or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    norm = library.hicache_rms_norm if x.dtype == torch.float32 else library.hicache_rms_norm_bf16
    norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps,
         _threads(rows * dim))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, D] rotated by cos/sin [T, 1, D / 2] into a new contiguous tensor; None:
    not here."""
    library = _usable(x, cos, sin)
    if (
        library is None or x.dim() != 3 or x.stride(2) != 1 or cos.stride() != sin.stride()
        or cos.dim() != 3 or cos.stride(2) != 1 or cos.shape[0] != x.shape[0]
    ):
        return None
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if cos.shape[2] != half or head_dim % 2:
        return None
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    rotate = library.hicache_rotary if x.dtype == torch.float32 else library.hicache_rotary_bf16
    rotate(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        out.data_ptr(), tokens, heads, half, _threads(tokens * heads * head_dim),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` [rows, width] of a 2-D ``gate_up`` [rows, 2 width] holding the
    two side by side (last dim contiguous); None: not here."""
    library = _usable(gate_up)
    if library is None or gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        return None
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    swiglu = (library.hicache_silu_mul if gate_up.dtype == torch.float32
              else library.hicache_silu_mul_bf16)
    swiglu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width,
           _threads(rows * width))
    return out
