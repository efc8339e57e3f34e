"""Products of a few rows by weights stored in blocks (``cpu_few_rows.cpp``), float32 or
bfloat16.

A decode step multiplies its few rows (one per decoding request) by every weight of the
model once: it is bound by reading the weights. ``block`` stores a weight [N, K] as
[N / 16, K, 16], so that the kernel streams each block of 16 output features once for
every 8 rows; on this project's CPU machine (2 threads, SmolLM2-135M's 30 layers and head
out of cache) that read the weights at 29 GB/s for 8 rows against 20 GB/s through
oneDNN's packed GEMM (docs/benchmarks.md). Past a few rows the product is bound by
arithmetic, where oneDNN's GEMM is the faster one, so the model uses these copies only up
to ``FEW_ROWS_MAX`` rows (``CausalLM.prepack_weights``).

Each function returns None where it does not apply (another dtype or device, inside
``torch.compile``, no compiler here): the caller then uses its other weights.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from hicache.kernels.cpu_build import CpuBuildError, LazyLibrary, build_and_load

logger = logging.getLogger(__name__)

# Products of up to this many rows go through the blocked copies. Measured against the
# packed GEMM over SmolLM2's weights, two threads: 1.5x at 1-8 rows, 1.2x at 16, 1.05x at
# 24-32 (docs/benchmarks.md); past 16 the gain is within noise and the copies are not used.
FEW_ROWS_MAX = 16

_SOURCE = Path(__file__).with_name("cpu_few_rows.cpp")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_ABI_VERSION = 3
_DTYPES = (torch.float32, torch.bfloat16)


def _unavailable(error: Exception) -> None:
    logger.warning("CPU few-row products unavailable (%s): oneDNN's run instead", error)


def _library() -> ctypes.CDLL | None:
    return _LIBRARY.get()


def _load() -> ctypes.CDLL:
    library = build_and_load(_SOURCE, _FLAGS)
    if library.hicache_few_rows_abi_version() != _ABI_VERSION:
        raise CpuBuildError(f"{library._name} has another ABI version")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (library.hicache_few_rows_linear, library.hicache_few_rows_linear_bf16):
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
        fn.restype = None
    return library


_LIBRARY = LazyLibrary(_load, (OSError, CpuBuildError), _unavailable)


def block_size() -> int | None:
    """Output features per block, or None where the kernel cannot run here."""
    library = _library()
    return None if library is None else int(library.hicache_few_rows_block())


def is_blocked(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a blocked copy made by ``block``."""
    return weight.dim() == 3 and not weight.is_mkldnn


def block(weight: torch.Tensor) -> torch.Tensor | None:
    """A blocked copy of ``weight`` [N, K], zeros past N, or None where the kernel cannot
    take it. float32: [ceil(N / 16), K, 16], output feature n in block n // 16 at lane
    n % 16. bfloat16: [ceil(N / 16), ceil(K / 2), 32], each k and k + 1 (k even) side by
    side in a lane's pair ([..., 16, 2] flattened), zeros past K."""
    size = block_size()
    if size is None or weight.dim() != 2 or weight.dtype not in _DTYPES or (
        weight.device.type != "cpu"
    ):
        return None
    n, k = weight.shape
    blocks = -(-n // size)
    pairs = 2 if weight.dtype == torch.bfloat16 else 1
    depth = -(-k // pairs)
    padded = weight.detach().new_zeros(blocks * size, depth * pairs)
    padded[:n, :k] = weight.detach()
    # [blocks, 16, depth, pairs] -> [blocks, depth, 16, pairs]
    grouped = padded.reshape(blocks, size, depth, pairs).permute(0, 2, 1, 3)
    return grouped.reshape(blocks, depth, size * pairs).contiguous()


def few_rows_linear(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x [..., K] and ``blocked`` the ``block`` copy of W [N, K]
    (``out_features`` N, default every row of the blocks); None where the kernel does not
    apply (then use W another way)."""
    library = _library()
    dtype = blocked.dtype
    if (
        library is None or x.dtype != dtype or x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))
    ):
        return None
    blocks, depth, lanes = blocked.shape
    pairs = 2 if dtype == torch.bfloat16 else 1
    size, k = lanes // pairs, x.shape[-1]
    if -(-k // pairs) != depth:
        raise ValueError(f"rows of {k} features against a weight blocked for {depth * pairs}")
    n = blocks * size if out_features is None else out_features
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=dtype)
    kernel = (library.hicache_few_rows_linear if dtype == torch.float32
              else library.hicache_few_rows_linear_bf16)
    kernel(
        rows.data_ptr(), rows.stride(0), rows.shape[0], blocked.data_ptr(), k, n,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
