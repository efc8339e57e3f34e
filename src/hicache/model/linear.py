"""Linear layers over weights prepacked for oneDNN on the CPU.

``F.linear`` on the CPU hands each call's weight to a GEMM that repacks it into
its blocked layout first: for the few rows of a decode step that repacking, a
full pass over the weight, costs more than the product itself. Packing each
weight once at load time (``prepack``) and calling oneDNN's linear on the packed
copy measured 1.5-3x faster on this project's CPU machine at every row count
from 1 to 2048 (float32, SmolLM2-135M shapes; docs/benchmarks.md).

oneDNN packs float32 everywhere; bfloat16 only on CPUs with AVX-512 BF16 / AVX-NE-
CONVERT, so ``prepack`` returns None where it cannot (the caller keeps F.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN picks its blocking for: packing for large products also measured
# best for a single row (within noise), while packing for one row slowed prefills.
_PACK_ROWS_HINT = 512
# Products of fewer rows use the plain weight: for a single row (one request decoding)
# the plain weight stored column-major (``column_major``) measured 25-30% faster than
# F.linear over the row-major weight and ~15% faster than the packed GEMM, one thread,
# SmolLM2's layer shapes streamed from memory (docs/benchmarks.md).
PACKED_FROM_ROWS = 2


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] with the same values, stored as its transpose: ``F.linear``
    then multiplies a row by a contiguous [in, out] matrix, which MKL streams faster
    for one row than the [out, in] layout F.linear otherwise transposes."""
    return weight.t().contiguous().t()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or oneDNN's linear when ``weight`` was prepacked."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of ``weight`` [out, in], or None where oneDNN cannot pack it."""
    if not can_prepack(weight):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _PACK_ROWS_HINT
        )
        return packed
    except RuntimeError:  # e.g. bfloat16 on a CPU without AVX-512 BF16
        return None
