"""Reference for io backend tests: a per-page copy through canonical views, plus fixtures.

The reference is deliberately naive (one Python assignment per page): every
io backend must leave the destination pool bit-for-bit equal to what it gives.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from hicache.config import MemLayout
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.memory.layout import PageStrides, canonical_view
from hicache.transfer.base import IOBackend

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
POISON = -3.5  # exactly representable in fp32, fp16 and bf16; never produced by fill_random


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers, so comparisons are bitwise (NaN-safe, -0 != +0)."""
    return t.view(_BITS[t.element_size()])


def fill_random(flat: torch.Tensor, seed: int) -> None:
    """Random non-zero data, never equal to POISON."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(flat.numel(), generator=gen) * 2 - 1  # [-1, 1)
    values = torch.where(values < 0, values - 0.25, values + 0.25)  # |v| >= 0.25
    flat.copy_(values.to(flat.dtype))


def poison(flat: torch.Tensor) -> None:
    flat.fill_(POISON)


def reference_copy(
    src_flat: torch.Tensor, src_strides: PageStrides, src_num_pages: int,
    dst_flat: torch.Tensor, dst_strides: PageStrides, dst_num_pages: int,
    geometry: KVGeometry, page_size: int,
    src_pages: torch.Tensor, dst_pages: torch.Tensor, layer: int | None,
) -> None:
    """Copy src_pages[i] (one layer or all) to dst_pages[i], one page at a time (CPU tensors)."""
    src = canonical_view(src_flat, src_strides, geometry, src_num_pages, page_size)
    dst = canonical_view(dst_flat, dst_strides, geometry, dst_num_pages, page_size)
    for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
        if layer is None:
            dst[d] = src[s]
        else:
            dst[d, layer] = src[s, layer]


def expected_load(
    host: HostPool, device: DevicePool, host_pages: torch.Tensor, device_pages: torch.Tensor,
    layer: int | None,
) -> torch.Tensor:
    """The device pool's flat buffer (on CPU) after a correct load."""
    out: torch.Tensor = device.flat.cpu().clone()
    reference_copy(
        host.flat, host.strides, host.num_pages, out, device.strides, device.num_pages,
        host.geometry, host.page_size, host_pages, device_pages, layer,
    )
    return out


def expected_store(
    host: HostPool, device: DevicePool, device_pages: torch.Tensor, host_pages: torch.Tensor,
    layer: int | None,
) -> torch.Tensor:
    """The host pool's flat buffer after a correct store."""
    out: torch.Tensor = host.flat.clone()
    reference_copy(
        device.flat.cpu(), device.strides, device.num_pages, out, host.strides, host.num_pages,
        host.geometry, host.page_size, device_pages, host_pages, layer,
    )
    return out


def scattered_pages(rng: random.Random, pool_pages: int, count: int) -> torch.Tensor:
    """``count`` distinct page ids: runs of 1-4 consecutive pages, in shuffled order.

    This is what an allocator hands out after some churn; the backends' run
    grouping and chunking must cope with it. Raises if the draw has no run of
    two or is monotonic, so a test never silently loses that coverage.
    """
    assert count <= pool_pages
    blocks: list[list[int]] = []
    page = 0
    while page < pool_pages:
        length = min(rng.randint(1, 4), pool_pages - page)
        blocks.append(list(range(page, page + length)))
        page += length
    rng.shuffle(blocks)
    ids = [p for block in blocks for p in block][:count]
    diffs = [b - a for a, b in itertools.pairwise(ids)]
    if count >= 4 and (1 not in diffs or all(d > 0 for d in diffs)):
        return scattered_pages(rng, pool_pages, count)  # redraw
    return torch.tensor(ids, dtype=torch.int64)


def make_pools(
    geometry: KVGeometry, layout: MemLayout, page_size: int, host_pages: int, device_pages: int,
    device: str = "cpu",
) -> tuple[HostPool, DevicePool]:
    host = HostPool(geometry, host_pages, page_size, layout)
    return host, DevicePool(geometry, device_pages, page_size, device)


def _sync(device: DevicePool) -> None:
    # Backends only enqueue on CUDA; the test observes completion like a caller would.
    if device.device.type == "cuda":
        torch.cuda.synchronize(device.device)


def check_round_trip(
    geometry: KVGeometry, layout: MemLayout, page_size: int, layer: int | None,
    make_backend: Callable[[HostPool, DevicePool], IOBackend], seed: int,
    host_pages: int = 24, device_pages: int = 16, moved: int = 10, device: str = "cpu",
) -> None:
    """L1 -> L2 -> L1: store scattered device pages, load them elsewhere, check each step.

    Destinations are poisoned first and compared whole, so a copy that writes
    outside its pages (or, layer-wise, outside its layer) fails.
    """
    host, dev = make_pools(geometry, layout, page_size, host_pages, device_pages, device)
    backend = make_backend(host, dev)
    rng = random.Random(seed)
    device_src = scattered_pages(rng, device_pages, moved)
    host_ids = scattered_pages(rng, host_pages, moved)
    device_dst = scattered_pages(rng, device_pages, moved)
    fill_random(dev.flat, seed)
    poison(host.flat)
    original = dev.flat.cpu().clone()

    want = expected_store(host, dev, device_src, host_ids, layer)
    backend.store(device_src, host_ids, layer)
    _sync(dev)
    assert torch.equal(bits(host.flat), bits(want)), "store differs from the reference"
    assert torch.equal(bits(dev.flat.cpu()), bits(original)), "store modified its source"

    poison(dev.flat)
    want = expected_load(host, dev, host_ids, device_dst, layer)
    backend.load(host_ids, device_dst, layer)
    _sync(dev)
    got_flat = dev.flat.cpu()
    assert torch.equal(bits(got_flat), bits(want)), "load differs from the reference"

    got = canonical_view(got_flat, dev.strides, geometry, device_pages, page_size)
    before = canonical_view(original, dev.strides, geometry, device_pages, page_size)
    if layer is None:
        assert torch.equal(bits(got[device_dst]), bits(before[device_src])), "round trip lost data"
    else:
        assert torch.equal(bits(got[device_dst, layer]), bits(before[device_src, layer]))
        others = [other for other in range(geometry.num_layers) if other != layer]
        assert bool((got[:, others] == POISON).all()), "a layer-wise load touched another layer"
