"""io backends on CUDA with a pinned host pool: bitwise equal to the reference.

Covers the kernel backend and every path of the direct backend (DMA blocks, CPU
gather/scatter, chunked staging), and that copies are ordered on the caller's
current stream, with staging never shared between streams.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import DEEPSEEK_V2_LITE, LLAMA3_8B, KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.transfer import DirectBackend, IOBackend
from hicache.transfer.kernel import KernelBackend
from tests.transfer_reference import (
    POISON,
    bits,
    check_round_trip,
    expected_load,
    expected_store,
    fill_random,
    make_pools,
    poison,
    reference_copy,
    scattered_pages,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

MakeBackend = Callable[[HostPool, DevicePool], IOBackend]

BACKENDS: dict[str, MakeBackend] = {
    "kernel": KernelBackend,
    "kernel_page_major": lambda host, device: KernelBackend(host, device, token_major=False),
    "kernel_token_major": lambda host, device: KernelBackend(host, device, token_major=True),
    "direct": DirectBackend,
    "direct_dma": lambda host, device: DirectBackend(host, device, min_dma_bytes=0),
    "direct_gather": lambda host, device: DirectBackend(host, device, min_dma_bytes=1 << 40),
    "direct_chunked": lambda host, device: DirectBackend(
        host, device, min_dma_bytes=0, staging_bytes=1
    ),
}
_LONG_SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: unordered work would overtake it


def test_pools_are_pinned_and_backends_are_real() -> None:
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    host, device = make_pools(geometry, MemLayout.PAGE_FIRST, 16, 4, 4, "cuda")
    assert host.flat.is_pinned()
    assert KernelBackend(host, device).name == "kernel"


@pytest.mark.parametrize("layer", [None, 0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cuda_matches_reference(
    backend: str, layout: MemLayout, page_size: int, dtype: torch.dtype, layer: int | None
) -> None:
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    check_round_trip(
        geometry, layout, page_size, layer, BACKENDS[backend], seed=page_size, device="cuda"
    )


@pytest.mark.parametrize("layer", [None, 1])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cuda_odd_row_matches_reference(backend: str, layout: MemLayout, layer: int | None) -> None:
    # 3 x 8 = 24-element rows: not a power of two (masked in the kernel)
    geometry = KVGeometry(num_layers=3, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    check_round_trip(geometry, layout, 16, layer, BACKENDS[backend], seed=5, device="cuda")


@pytest.mark.parametrize("layer", [None, 1])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cuda_mla_matches_reference(
    backend: str, layout: MemLayout, page_size: int, layer: int | None
) -> None:
    # One latent plane per layer, 24 elements (masked in the kernel).
    geometry = KVGeometry.mla(num_layers=3, latent_dim=24, dtype=torch.bfloat16)
    check_round_trip(
        geometry, layout, page_size, layer, BACKENDS[backend], seed=6, device="cuda"
    )


@pytest.mark.parametrize("layer", [None, 17])
@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("geometry", [LLAMA3_8B, DEEPSEEK_V2_LITE], ids=["llama3-8b", "dsv2-lite"])
def test_real_geometry_128_scattered_pages(
    backend: str, layout: MemLayout, layer: int | None, geometry: KVGeometry
) -> None:
    check_round_trip(
        geometry, layout, 16, layer, BACKENDS[backend], seed=8,
        host_pages=144, device_pages=136, moved=128, device="cuda",
    )


@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_copies_run_on_the_current_stream(backend: str, layout: MemLayout) -> None:
    """Work queued on the current (non-default) stream before a call lands before its copy."""
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    host, device = make_pools(geometry, layout, 16, 12, 10, "cuda")
    io = BACKENDS[backend](host, device)
    device_pages = torch.tensor([4, 5, 1, 8, 2])
    host_pages = torch.tensor([9, 10, 11, 0, 3])
    fresh = torch.empty(device.flat.numel(), dtype=device.flat.dtype)
    fill_random(fresh, 11)
    poison(host.flat)
    want_host = host.flat.clone()
    reference_copy(
        fresh, device.strides, device.num_pages, want_host, host.strides, host.num_pages,
        geometry, 16, device_pages, host_pages, None,
    )
    fresh_cuda = fresh.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pools' initialisation
    with torch.cuda.stream(side):
        torch.cuda._sleep(_LONG_SLEEP_CYCLES)
        device.flat.copy_(fresh_cuda)  # the data to store exists only after the sleep
        io.store(device_pages, host_pages)
    side.synchronize()
    assert torch.equal(bits(host.flat), bits(want_host))

    load_to = device_pages.flip(0)
    want_device = torch.full((device.flat.numel(),), POISON, dtype=device.flat.dtype)
    reference_copy(
        host.flat, host.strides, host.num_pages, want_device, device.strides, device.num_pages,
        geometry, 16, host_pages, load_to, None,
    )
    with torch.cuda.stream(side):
        torch.cuda._sleep(_LONG_SLEEP_CYCLES)
        device.flat.fill_(POISON)  # a load not ordered after this fill would be overwritten
        io.load(host_pages, load_to)
    side.synchronize()
    assert torch.equal(bits(device.flat.cpu()), bits(want_device))


@pytest.mark.parametrize("layout", list(MemLayout))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_concurrent_load_and_store_on_two_streams(backend: str, layout: MemLayout) -> None:
    """The controller stores on one stream while it loads on another: no shared staging."""
    geometry = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    host, device = make_pools(geometry, layout, 16, 32, 32, "cuda")
    io = BACKENDS[backend](host, device)
    ids = scattered_pages(random.Random(3), 32, 32)  # every page once
    store_device, load_device = ids[:16], ids[16:]
    store_host, load_host = ids.flip(0)[:16], ids.flip(0)[16:]  # disjoint halves too
    fill_random(device.flat, 12)
    fill_random(host.flat, 13)
    want_host = expected_store(host, device, store_device, store_host, None)
    want_device = expected_load(host, device, load_host, load_device, None)
    writer, loader = torch.cuda.Stream(), torch.cuda.Stream()
    writer.wait_stream(torch.cuda.current_stream())
    loader.wait_stream(torch.cuda.current_stream())
    for _ in range(3):  # both streams busy at once; chunked staging reuses its buffer often
        with torch.cuda.stream(writer):
            io.store(store_device, store_host)
        with torch.cuda.stream(loader):
            io.load(load_host, load_device)
    torch.cuda.synchronize()
    assert torch.equal(bits(host.flat), bits(want_host))
    assert torch.equal(bits(device.flat.cpu()), bits(want_device))
