"""Host buffers pinned to exactly their size (cudaHostRegister), not a power of two."""

from __future__ import annotations

import gc

import pytest
import torch

from hicache.memory.host_memory import empty_host

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _caching_host_allocator_bytes() -> int | None:
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)  # torch >= 2.6
    return None if stats is None else int(stats().get("allocated_bytes.current", 0))


def test_a_pinned_host_buffer_is_exactly_its_size_and_copies_both_ways() -> None:
    numel = 3 * 2**20 + 7  # far from a power of two
    stats_before = _caching_host_allocator_bytes()
    flat = empty_host(numel, torch.bfloat16, pin=True)
    assert flat.is_pinned()
    assert flat.numel() == numel and flat.dtype == torch.bfloat16
    # Not from PyTorch's caching host allocator (which would round it up).
    assert _caching_host_allocator_bytes() == stats_before
    source = torch.randn(numel, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # ``source`` was made on the default stream
    with torch.cuda.stream(stream):
        flat.copy_(source, non_blocking=True)
        back = flat.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, source)
    # A view keeps the registration (and the memory) alive after the buffer's name is gone.
    view = flat[5:]
    del flat
    gc.collect()
    assert view.is_pinned()
    assert torch.equal(view.to("cuda"), source[5:])
    del view
    gc.collect()
    torch.cuda.synchronize()
