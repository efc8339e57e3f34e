"""DirectBackend: page copies with torch operations only, no custom kernels.

Same device (CPU pools, as in CI): through the canonical ``[pages, layers, planes,
page_size, row]`` views, whatever the layout (planes: K and V, or the one MLA latent),
one ``copy_`` per page where a page's part is large (``PER_PAGE_COPY_MIN_BYTES``), else
one ``index_select`` + ``index_copy_`` for all pages (which copies twice, through a
temporary, but costs two calls whatever the number of pages).

Device pool on CUDA: the host pool is only reachable by DMA, and torch copies a
strided (non-contiguous) host tensor through a pageable temporary. So every copy
goes through a device *staging* buffer laid out in the host layout's memory
order, which turns each host-side piece into one contiguous DMA:

    load : host --DMA per block--> staging --one index_copy_ (scatter)--> device pool
    store: device pool --one index_select (gather)--> staging --DMA per block--> host

A block is the largest piece of a request that is contiguous in host memory:
a run of consecutive host pages (page_first, page_first_direct), or a run's
slice of one (layer, plane) (layer_first). Python loops over blocks, so the cost
is O(runs) or O(runs x layers x planes) DMA calls, never O(pages x layers) when
pages are allocated in runs. Where a load's blocks would be tiny, or a page's
selected part is not contiguous (see ``_use_dma``), the host side goes through a
pinned staging buffer instead: one CPU ``index_select`` and one DMA per chunk.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hicache.memory.device_pool import DevicePool
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import IOBackend, TransferError

# Device (and pinned host) staging is bounded: larger requests are moved in chunks.
DEFAULT_STAGING_BYTES = 256 << 20
# Below this average block size one DMA per block costs more than a CPU gather
# into pinned staging plus one DMA. Measured on an H100 (Llama-3-8B KV, bf16):
# one DMA per block costs ~10 us of overhead (128 KiB blocks: 7 GB/s; 2 MiB:
# 44 GB/s) while the gather path runs at ~20 GB/s, so they break even near 300 KB.
DEFAULT_MIN_DMA_BYTES = 512 << 10
# CPU pools: from this many bytes of a page per copy (a whole page, or one layer of it)
# one copy_ per page beats index_select + index_copy_. Measured on the 2-core CPU
# machine, 8 MiB Llama-3-8B pages: whole pages 28-38 GB/s against 3 GB/s, one layer
# (256 KiB) 14-20 against 7-8; 64 KiB a layer even, 48 KiB and below the batched
# pair wins (12 KiB: 8 GB/s against 2.5).
PER_PAGE_COPY_MIN_BYTES = 64 << 10


def check_page_ids(ids: torch.Tensor, num_pages: int, pool: str) -> None:
    """Raise TransferError unless ``ids`` is a CPU tensor of page ids in [0, num_pages).

    A kernel would silently read or write out of bounds, so this is checked on
    the CPU (where the lists live) before anything is enqueued.
    """
    if ids.device.type != "cpu":
        raise TransferError(f"{pool} page ids must be a CPU tensor, got one on {ids.device}")
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_pages:
        raise TransferError(
            f"{pool} page ids must lie in [0, {num_pages}), got values in [{low}, {high}]"
        )


def page_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of consecutive ids (ids[i + 1] == ids[i] + 1): (start positions, lengths)."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.append(starts, ids.size))
    return starts, lengths


@dataclass(frozen=True)
class _Plan:
    """One layer selection (all layers, or one) of both pools, in host memory order.

    ``host`` and ``device`` are the canonical views (page dim 0) with their dims
    permuted so that the host's strides decrease: a staging tensor of shape
    ``stage_shape(n)`` then has the host's memory order, so a run of host pages
    maps to contiguous staging memory. Dims before ``page_axis`` are "outer"
    (only layer_first has them: [layers, planes]).
    """

    host: torch.Tensor  # [*outer, host_pages, *inner] (a view of host.flat)
    device: torch.Tensor  # [*outer, device_pages, *inner] (a view of device.flat)
    page_axis: int
    outer: tuple[tuple[int, ...], ...]  # every index over the outer dims
    inner_contiguous: bool  # one page's inner part is one contiguous host block
    pages_adjacent: bool  # and consecutive host pages' blocks touch
    page_elems: int  # elements of the selected part of one page

    def stage_shape(self, num_pages: int) -> tuple[int, ...]:
        shape = list(self.host.shape)
        shape[self.page_axis] = num_pages
        return tuple(shape)


def _make_plan(host_view: torch.Tensor, device_view: torch.Tensor) -> _Plan:
    # Ties (size-1 dims, or a 1-page pool) keep canonical order; any order is
    # correct, the sort only decides which copies are contiguous.
    strides = host_view.stride()
    order = sorted(range(host_view.dim()), key=lambda d: (-strides[d], d))
    host = host_view.permute(order)
    page_axis = order.index(0)
    inner_shape = host.shape[page_axis + 1 :]
    expected = 1
    inner_contiguous = True
    inner_strides = host.stride()[page_axis + 1 :]
    for size, stride in zip(reversed(inner_shape), reversed(inner_strides), strict=True):
        if size != 1 and stride != expected:
            inner_contiguous = False
        expected *= size
    inner_elems = math.prod(inner_shape)
    outer_shape = host.shape[:page_axis]
    return _Plan(
        host=host,
        device=device_view.permute(order),
        page_axis=page_axis,
        outer=tuple(itertools.product(*(range(size) for size in outer_shape))),
        inner_contiguous=inner_contiguous,
        pages_adjacent=inner_contiguous and host.stride(page_axis) == inner_elems,
        page_elems=inner_elems * math.prod(outer_shape),
    )


@dataclass
class _Stage:
    """A reusable flat buffer and, on CUDA, the event after the last copy reading it."""

    buffer: torch.Tensor
    read_done: torch.cuda.Event | None = None


class DirectBackend(IOBackend):
    """Torch copies: indexed copies on one device, staged DMA between host and CUDA.

    ``staged`` forces (True) or forbids (False) the staged path; by default it is
    used exactly when the device pool is on CUDA. Forcing it on CPU pools runs
    the CUDA code path's logic (runs, chunks, blocks, gathers) in tests.

    Staging buffers are kept per CUDA stream (per thread on CPU), so a load and a
    store issued on different streams never share one. Within one stream reuse is
    safe by stream order: every copy that reads or writes a staging buffer is
    enqueued on the current stream, so the next call's first write to it runs
    after this call's last read. Host-side (pinned) staging is read by the CPU
    too, so before refilling it we wait for the event of the last DMA reading it.
    """

    name = "direct"

    def __init__(
        self,
        host: HostPool,
        device: DevicePool,
        *,
        staged: bool | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        min_dma_bytes: int = DEFAULT_MIN_DMA_BYTES,
    ) -> None:
        super().__init__(host, device)
        self._cuda = device.device.type == "cuda"
        self._staged = self._cuda if staged is None else staged
        if not self._staged and device.device.type != "cpu":
            raise TransferError(f"the unstaged path needs a CPU device pool, not {device.device}")
        if staging_bytes <= 0:
            raise TransferError(f"staging_bytes must be positive, got {staging_bytes}")
        self._staging_bytes = staging_bytes
        self._min_dma_bytes = min_dma_bytes
        self._elem_bytes = device.geometry.element_bytes
        self._plans: dict[int | None, _Plan] = {}
        self._device_stages: dict[int, _Stage] = {}
        self._host_stages: dict[int, _Stage] = {}

    # ------------------------------------------------------------- interface
    def load(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        self._validate(host_pages, device_pages, layer, to_device=True)
        if host_pages.numel() == 0:
            return
        if self._staged:
            self._staged_copy(self._plan(layer), host_pages, device_pages, to_device=True)
            return
        src, dst = self._views(layer)
        # [n, layers, planes, page_size, row] (or [n, planes, page_size, row] for one layer)
        self._cpu_copy(src, host_pages, dst, device_pages, layer)

    def store(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        self._validate(device_pages, host_pages, layer, to_device=False)
        if device_pages.numel() == 0:
            return
        if self._staged:
            self._staged_copy(self._plan(layer), host_pages, device_pages, to_device=False)
            return
        dst, src = self._views(layer)
        self._cpu_copy(src, device_pages, dst, host_pages, layer)

    def _cpu_copy(
        self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor,
        layer: int | None,
    ) -> None:
        """``dst[dst_ids[i]] = src[src_ids[i]]`` between CPU pools (see the module doc)."""
        part_bytes = self.host.page_bytes
        if layer is not None:
            part_bytes //= self.host.geometry.num_layers
        if part_bytes < PER_PAGE_COPY_MIN_BYTES:
            dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))
            return
        for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
            dst[d].copy_(src[s])

    # ----------------------------------------------------------------- setup
    def _validate(
        self, src: torch.Tensor, dst: torch.Tensor, layer: int | None, *, to_device: bool
    ) -> None:
        self._check(src, dst, layer)
        host_ids, device_ids = (src, dst) if to_device else (dst, src)
        check_page_ids(host_ids, self.host.num_pages, "host")
        check_page_ids(device_ids, self.device.num_pages, "device")

    def _views(self, layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) canonical views restricted to ``layer`` (page dim first)."""
        if layer is None:
            return self.host.pages, self.device.pages
        return self.host.pages[:, layer], self.device.pages[:, layer]

    def _plan(self, layer: int | None) -> _Plan:
        plan = self._plans.get(layer)
        if plan is None:
            plan = _make_plan(*self._views(layer))
            self._plans[layer] = plan
        return plan

    # ---------------------------------------------------------------- staged
    def _staged_copy(
        self, plan: _Plan, host_ids: torch.Tensor, device_ids: torch.Tensor, *, to_device: bool
    ) -> None:
        n = host_ids.numel()
        page_bytes = plan.page_elems * self._elem_bytes
        chunk = max(1, min(n, self._staging_bytes // page_bytes))
        # Page ids come as (pageable) CPU tensors; the device side needs its ids on
        # the device. The copy is stream-ordered like everything below.
        device_idx = device_ids.to(self.device.device, non_blocking=True)
        host_np = host_ids.numpy()
        use_dma = self._use_dma(plan, host_np, page_bytes, to_device=to_device)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            stage = self._device_stage(plan.stage_shape(stop - start))
            dev_idx = device_idx[start:stop]
            if to_device:
                if use_dma:
                    self._dma_blocks(plan, host_np[start:stop], stage, to_device=True)
                else:
                    self._gather_host(plan, host_ids[start:stop], stage)
                plan.device.index_copy_(plan.page_axis, dev_idx, stage)
            else:
                torch.index_select(plan.device, plan.page_axis, dev_idx, out=stage)
                if use_dma:
                    self._dma_blocks(plan, host_np[start:stop], stage, to_device=False)
                else:
                    self._scatter_host(plan, host_ids[start:stop], stage)

    def _use_dma(
        self, plan: _Plan, host_np: np.ndarray, page_bytes: int, *, to_device: bool
    ) -> bool:
        """One DMA per contiguous host block, unless blocks are too small to be worth it.

        Not contiguous within a page (page_first, one layer: P rows of planes x row
        elements, L x planes x row apart) always goes through the CPU: a DMA per row
        would be O(tokens) calls. page_first_direct, one layer, is one block of
        planes x page_size x row per page (pages are L x that apart): O(pages) DMAs.
        Stores always use DMA where they can: the CPU scatter path has to wait
        for the stream, and the controller issues stores from its own thread.
        """
        if not plan.inner_contiguous:
            return False
        if not to_device:
            return True
        pieces = len(page_runs(host_np)[0]) if plan.pages_adjacent else host_np.size
        blocks = pieces * len(plan.outer)
        return host_np.size * page_bytes >= blocks * self._min_dma_bytes

    def _dma_blocks(
        self, plan: _Plan, host_np: np.ndarray, stage: torch.Tensor, *, to_device: bool
    ) -> None:
        if plan.pages_adjacent:
            starts, lengths = page_runs(host_np)
        else:
            starts = np.arange(host_np.size)
            lengths = np.ones(host_np.size, dtype=np.int64)
        blocks = list(
            zip(starts.tolist(), lengths.tolist(), host_np[starts].tolist(), strict=True)
        )
        for outer in plan.outer:
            staged = stage[outer]  # [n, *inner], contiguous
            host = plan.host[outer]  # [host_pages, *inner]
            for pos, length, host_page in blocks:
                device_block = staged.narrow(0, pos, length)
                host_block = host.narrow(0, host_page, length)
                if to_device:
                    device_block.copy_(host_block, non_blocking=True)
                else:
                    host_block.copy_(device_block, non_blocking=True)

    def _gather_host(self, plan: _Plan, host_ids: torch.Tensor, stage: torch.Tensor) -> None:
        """CPU gather into pinned staging, then one DMA (load, small-block path).

        The CPU reads the host pool now, at enqueue time (the contract already
        forbids touching those pages while a copy is pending).
        """
        host_stage = self._host_stage(stage.numel())
        if host_stage.read_done is not None:
            host_stage.read_done.synchronize()  # the previous DMA out of it has finished
        pinned = host_stage.buffer[: stage.numel()].view(stage.shape)
        torch.index_select(plan.host, plan.page_axis, host_ids, out=pinned)
        stage.copy_(pinned, non_blocking=True)
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device.device))
            host_stage.read_done = event

    def _scatter_host(self, plan: _Plan, host_ids: torch.Tensor, stage: torch.Tensor) -> None:
        """One DMA into pinned staging, then a CPU scatter (store into non-contiguous pages).

        The CPU must see the data, so this waits for the stream: only a
        layer-wise store into a page_first pool comes here, and it blocks the
        calling thread.
        """
        host_stage = self._host_stage(stage.numel())
        pinned = host_stage.buffer[: stage.numel()].view(stage.shape)
        pinned.copy_(stage)  # blocking: returns once the data is in host memory
        plan.host.index_copy_(plan.page_axis, host_ids, pinned)

    # --------------------------------------------------------------- staging
    def _stream_key(self) -> int:
        if self._cuda:
            return int(torch.cuda.current_stream(self.device.device).cuda_stream)
        return threading.get_ident()

    def _device_stage(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``shape`` in this stream's device staging buffer."""
        numel = math.prod(shape)
        key = self._stream_key()
        stage = self._device_stages.get(key)
        if stage is None or stage.buffer.numel() < numel:
            # Allocated on (and only ever used on) this stream: when an old buffer
            # is dropped, the caching allocator reuses its memory only after the
            # work already enqueued on this stream.
            buffer = torch.empty(numel, dtype=self.device.flat.dtype, device=self.device.device)
            stage = _Stage(buffer)
            self._device_stages[key] = stage
        return stage.buffer[:numel].view(shape)

    def _host_stage(self, numel: int) -> _Stage:
        key = self._stream_key()
        stage = self._host_stages.get(key)
        if stage is None or stage.buffer.numel() < numel:
            # Pinned so the DMA is asynchronous. A dropped pinned buffer is safe:
            # torch's host allocator holds it until recorded copies finish.
            buffer = torch.empty(numel, dtype=self.host.flat.dtype, pin_memory=self._cuda)
            stage = _Stage(buffer)
            self._host_stages[key] = stage
        return stage
