"""Decode steps captured once per batch-size bucket and replayed: CUDA graphs.

A decode step of a small model on a GPU is a few hundred short kernels; launching
them one by one from Python costs more than running them. So at start-up the
engine records the whole decode forward once per batch size in ``buckets`` (a
CUDA graph each, sharing one memory pool) and then each decode step only copies
its inputs into the graphs' static buffers and replays the smallest bucket that
holds the batch.

What makes one recording serve every step:

- One static input buffer, ``[3, max bucket]`` int64 (token ids, positions, page
  table rows), copied from the host in one transfer per step. Everything else is
  computed inside the graph from it: each token's slot (through the runner's
  persistent page table, whose tensor never moves), the lengths (position + 1).
- Attention reads the lengths from the device (``reads_device_lengths``: the
  Triton decode kernel); the host-side lengths the batch carries are an upper
  bound, the longest context the engine admits, sized once.
- Rows beyond the batch (the bucket's padding) decode token 0 at position 0 of a
  page-table row and a device page reserved for them: they write and read only
  that page, and their logits are dropped.

On a CPU there is nothing to capture (the engine never enables this there); the
same recorded function then runs eagerly on each replay (``capture=False``), which
is how the tests check the static-buffer step against the normal one without a GPU.
At start-up the engine checks a replay against the eager step and turns the graphs
off, with a warning, if they differ (``self_check``).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hicache.attention.triton import TritonBackend
from hicache.engine.page_table import ReqToPageTable
from hicache.memory.device_pool import DevicePool
from hicache.model.batch import ForwardBatch
from hicache.model.model import CausalLM

logger = logging.getLogger(__name__)

# Batch sizes recorded (up to the configured maximum, which is always one of them):
# every size up to 8 costs little to record and small batches are the common case;
# past that, steps of 8 and then 16 keep a padded batch within ~15% of its size.
_BUCKETS = (1, 2, 3, 4, 6, 8, *range(16, 64, 8), *range(64, 1025, 16))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes to record for batches of up to ``max_batch`` sequences."""
    if max_batch < 1:
        raise ValueError(f"the largest decode batch must be >= 1, got {max_batch}")
    sizes = [size for size in _BUCKETS if size < max_batch]
    return (*sizes, max_batch)


class _Recording:
    """One bucket's step: a CUDA graph and its output, or (no capture) the function."""

    def __init__(
        self, fn: Callable[[], torch.Tensor], capture: bool, pool: Any,
    ) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = fn()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        assert self.output is not None
        return self.output


class DecodeGraphs:
    """Recorded decode steps for batches of up to ``max_batch`` sequences (module docstring).

    ``table``: the runner's page table; one of its rows and one page of ``pool`` are
    taken for the padding rows for good. ``max_context_len``: the longest context a
    decode may have (the bound attention sizes its work by).
    """

    def __init__(
        self, model: CausalLM, pool: DevicePool, table: ReqToPageTable, max_batch: int,
        max_context_len: int, *, capture: bool,
    ) -> None:
        if model.config.mla is not None:
            raise ValueError("decode graphs cover MHA/GQA models (MLA steps plan on the host)")
        if model.tp.size != 1:
            raise ValueError("decode graphs run at tensor-parallel size 1")
        self.model = model
        self.pool = pool
        self.table = table
        self.capture = capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.bound = max_context_len
        self.attention = TritonBackend()
        device = pool.device
        self.page = int(pool.allocator.reserve(1)[0])  # the padding rows' K/V
        self.row = table.acquire()
        table.write(self.row, 0, np.array([self.page], dtype=np.int64))
        table.flush()
        self._padding = (0, 0, self.row)  # token, position, row
        self.inputs = torch.empty((3, self.max_batch), dtype=torch.int64, device=device)
        self._fill_padding(0)
        self._recordings: dict[int, _Recording] = {}
        self.replays: Counter[int] = Counter()  # replays per bucket (metrics, tests)
        mempool = torch.cuda.graph_pool_handle() if capture else None
        # Largest first: the smaller graphs then fit in the memory the largest reserved.
        for size in reversed(self.buckets):
            fn = self._step_function(size)
            if capture:
                self._warm_up(fn)
            self._recordings[size] = _Recording(fn, capture, mempool)

    # ------------------------------------------------------------------ replay
    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def bucket(self, batch_size: int) -> int:
        """The smallest recorded size that holds ``batch_size`` sequences."""
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def replay(
        self, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int],
        wait_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Decode token ``ids[i]`` at ``positions[i]`` of page-table row ``rows[i]``;
        logits [len(ids), vocab], a tensor of their own (the graph's output buffer is
        overwritten by the next replay, and rows of logits may be kept past it)."""
        count = len(ids)
        size = self.bucket(count)
        pad = size - count
        token, position, row = self._padding
        host = torch.tensor(
            [[*ids, *(token,) * pad], [*positions, *(position,) * pad], [*rows, *(row,) * pad]],
            dtype=torch.int64,
        )
        self.inputs[:, :size].copy_(host, non_blocking=True)
        if wait_layer is not None:
            # Loads from host memory land per layer; a recorded step cannot wait between
            # its layers, so it waits for all of them before it starts.
            for layer in range(self.model.config.num_layers):
                wait_layer(layer)
        self.replays[size] += 1
        return self._recordings[size].replay()[:count].clone()

    def self_check(self) -> str | None:
        """Replay each bucket on padding rows and compare with the eager step; None if
        they agree, else what differed."""
        self._fill_padding(0)
        for size in self.buckets:
            recorded = self._recordings[size].replay().clone()
            eager = self._step_function(size)()
            # Same kernels on the same inputs; only a library picking another algorithm
            # inside the recording could move the result, by rounding.
            tolerance = 1e-4 if self.model.dtype == torch.float32 else 2e-2
            if not torch.allclose(recorded, eager, rtol=tolerance, atol=tolerance):
                error = (recorded - eager).abs().max().item()
                return f"the recorded step of {size} rows differs from the eager one by {error}"
        return None

    # --------------------------------------------------------------- recording
    def _step_function(self, size: int) -> Callable[[], torch.Tensor]:
        inputs, table, ps = self.inputs[:, :size], self.table.table, self.pool.page_size
        model, pool, attention = self.model, self.pool, self.attention
        bound = (self.bound,) * size

        def step() -> torch.Tensor:
            ids, positions = inputs[0], inputs[1]
            rows = inputs[2].to(torch.int32)
            pages = table[rows.long(), positions // ps]
            batch = ForwardBatch(
                input_ids=ids, positions=positions,
                out_slots=pages.long() * ps + positions % ps,
                extend_lens=(1,) * size, seq_lens=bound, page_table=table, table_rows=rows,
                page_size=ps, device_seq_lens=(positions + 1).to(torch.int32),
            )
            return model.forward(batch, pool, attention=attention)

        return step

    def _fill_padding(self, upto: int) -> None:
        token, position, row = self._padding
        self.inputs[0, upto:] = token
        self.inputs[1, upto:] = position
        self.inputs[2, upto:] = row

    @staticmethod
    def _warm_up(fn: Callable[[], torch.Tensor]) -> None:
        """Run the step eagerly on a side stream first: Triton compiles its kernels and
        cuBLAS picks its algorithms outside the recording."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
