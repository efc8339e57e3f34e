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

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hicache.kernels.few_rows import few_rows_linear, is_blocked

# The row count oneDNN picks its blocking for: packing for large products also measured
# best for a single row (within noise), while packing for one row slowed prefills.
_PACK_ROWS_HINT = 512
# Products of fewer rows may use the plain weight: for a single row (one request decoding)
# the plain weight stored column-major (``column_major``) measured 25-30% faster than
# F.linear over the row-major weight and ~15% faster than the packed GEMM on an AVX2
# EPYC, one thread, SmolLM2's layer shapes streamed from memory; on an AVX-512 EPYC the
# packed GEMM was 30% faster than it instead (docs/benchmarks.md). So which one a model
# uses for one row is measured when its weights are packed (``column_major_is_faster``).
PACKED_FROM_ROWS = 2
# How much of a model's weights the one-row measurement streams: past the last-level cache
# of the CPUs we run on, so that it sees memory bandwidth as a decode step does.
_ONE_ROW_SAMPLE_BYTES = 256 * 2**20
_ONE_ROW_REPEATS = 5


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] with the same values, stored as its transpose: ``F.linear``
    then multiplies a row by a contiguous [in, out] matrix, which MKL streams faster
    for one row than the [out, in] layout F.linear otherwise transposes."""
    return weight.t().contiguous().t()


def one_row_clock() -> Callable[[], float]:
    """The clock ``column_major_is_faster`` times with. On one torch thread the products run
    on the calling thread alone, so its CPU time is their cost, without the time the OS gave
    its core to other work: on a 2-core machine shared with other jobs, wall-time medians of
    the two layouts swapped places between runs (18.4 / 19.9 ms, then 57.3 / 47.1 ms) where
    thread CPU times held (18.2-18.5 / 19.8-20.3 ms), and the slower layout costs a single
    request every decode step of the server's life. With more threads the wall clock (CPU
    time would also count the workers' spinning)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def column_major_is_faster(
    weights: Sequence[torch.Tensor], packed: Sequence[torch.Tensor],
    sample_bytes: int = _ONE_ROW_SAMPLE_BYTES, repeats: int = _ONE_ROW_REPEATS,
) -> bool:
    """Whether one-row products over column-major copies of ``weights`` run faster here
    than over their ``packed`` copies, timed now (``one_row_clock``) over the first weights
    adding up to ``sample_bytes`` (temporary column-major copies of those are made), median
    of ``repeats`` passes each, in turns."""
    count = sample_count(weights, sample_bytes)
    columns = [column_major(w.detach()) for w in weights[:count]]
    first, second = timed_products(1, columns, packed[:count], repeats)
    return first < second


def timed_products(
    rows: int, first: Sequence[torch.Tensor], second: Sequence[torch.Tensor],
    repeats: int = _ONE_ROW_REPEATS,
) -> tuple[float, float]:
    """Median times of a pass of ``rows``-row products over each of two sets of copies of
    the same weights (``first[i]`` and ``second[i]`` one weight's), ``repeats`` passes
    each in turns after one to warm up, on ``one_row_clock``."""
    inputs = [torch.randn(rows, _in_features(a, b)).to(a.dtype)
              for a, b in zip(first, second, strict=True)]
    clock = one_row_clock()

    def one_pass(mats: Sequence[torch.Tensor]) -> float:
        start = clock()
        for x, mat in zip(inputs, mats, strict=True):
            linear(x, mat)
        return clock() - start

    with torch.inference_mode():
        one_pass(first), one_pass(second)  # warm up both paths
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            times[0].append(one_pass(first))
            times[1].append(one_pass(second))
    return statistics.median(times[0]), statistics.median(times[1])


def sample_count(weights: Sequence[torch.Tensor], sample_bytes: int = _ONE_ROW_SAMPLE_BYTES
                 ) -> int:
    """How many of the first ``weights`` add up to ``sample_bytes``: past the last-level
    cache, so that products timed over them see memory bandwidth as a decode step does."""
    count, total = 0, 0
    while count < len(weights) and total < sample_bytes:
        total += weights[count].numel() * weights[count].element_size()
        count += 1
    return count


def _in_features(*copies: torch.Tensor) -> int:
    """K of a weight [N, K] from its copies: a plain, column-major or packed one says it
    (a blocked bfloat16 copy holds K rounded up to pairs)."""
    flat = [w for w in copies if w.dim() == 2]
    assert flat, "no copy in [N, K] form"
    return flat[0].shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or oneDNN's linear when ``weight`` was prepacked, or the few-row
    kernel when it is a blocked copy (``hicache.kernels.few_rows.block``)."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    if is_blocked(weight):
        few = few_rows_linear(x, weight, bias)
        if few is not None:
            return few
        # Not expected (the model uses blocked copies only where the kernel runs): the
        # weight unblocked for this call, so the answer stays right.
        blocks, depth, lanes = weight.shape
        pairs = 2 if weight.dtype == torch.bfloat16 else 1
        unblocked = weight.reshape(blocks, depth, lanes // pairs, pairs).permute(0, 2, 1, 3)
        weight = unblocked.reshape(blocks * lanes // pairs, depth * pairs)[:, : x.shape[-1]]
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
