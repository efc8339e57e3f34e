"""The correctness oracle: KV as a cold prefill would write it, and a request that checks reuse.

"Computing" a token writes KV that is a deterministic function of its whole
prefix, so KV served from any tier can be compared bit-for-bit with cold KV.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.memory.allocator import OutOfPagesError
from hicache.memory.geometry import KVGeometry
from tests.waiting import wait_until


def expected_kv(tokens: list[int], geometry: KVGeometry, page_size: int) -> torch.Tensor:
    """KV a cold prefill writes: [pages, layers, planes, page_size, row], a function of each
    prefix (planes: K and V, or the one MLA latent)."""
    planes = geometry.kv_planes
    if not tokens:
        shape = (0, geometry.num_layers, planes, page_size, geometry.row_elems)
        return torch.empty(shape, dtype=geometry.dtype)
    rows = []
    for i in range(len(tokens)):
        seed = zlib.crc32(np.asarray(tokens[: i + 1], dtype=np.int32).tobytes())
        gen = torch.Generator().manual_seed(seed)
        rows.append(torch.randn(geometry.num_layers, planes, geometry.row_elems, generator=gen))
    kv = torch.stack(rows, dim=2)  # [layers, planes, tokens, row]
    num_pages = len(tokens) // page_size
    kv = kv.reshape(geometry.num_layers, planes, num_pages, page_size, geometry.row_elems)
    return kv.permute(2, 0, 1, 3, 4).to(geometry.dtype)


def serve(cache: HierarchicalCache, tokens: list[int]) -> int:
    """One request: reuse what is cached, compute the rest, check reused KV; returns hit tokens."""
    ps = cache.page_size
    geometry = cache.device_pool.geometry
    device = cache.device_pool.device
    hit = cache.acquire(tokens)
    for layer in range(geometry.num_layers):
        cache.wait_layer(layer)
    full = len(tokens) // ps * ps
    want = expected_kv(tokens[:full], geometry, ps).to(device)
    cached_pages = len(hit.device_pages)
    if cached_pages:
        got = cache.device_pool.pages[torch.from_numpy(hit.device_pages).to(device)]
        assert torch.equal(got, want[:cached_pages]), "cached KV differs from cold KV"
    new_pages = full // ps - cached_pages
    try:
        fresh = cache.alloc_device(new_pages)
    except OutOfPagesError:
        cache.release(hit)
        return hit.num_tokens
    cache.device_pool.pages[torch.from_numpy(fresh).to(device)] = want[cached_pages:]
    cache.insert(tokens[:full], np.concatenate([hit.device_pages, fresh]))
    cache.release(hit)
    cache.poll()
    cache.check_integrity()
    return hit.num_tokens


# ------------------------------------------------------------- with an L3 tier
# How long a prefetch or the L3 traffic after a request may take to finish: a guard against
# a hang, far above what a machine busy with other work needs.
L3_WAIT_S = 60.0


def settle(cache: HierarchicalCache) -> None:
    """Let every device->host copy land and every L3 operation finish, then check integrity."""
    cache.poll(wait=True)
    if cache.storage is not None:
        assert cache.storage.controller.wait_idle(L3_WAIT_S)
    cache.poll()
    cache.check_integrity()


def serve_with_l3(cache: HierarchicalCache, tokens: list[int]) -> int:
    """The engine's order: prefetch, hold until ready, finish, then ``serve`` as usual."""
    handle = cache.prefetch(tokens)
    if handle is not None:

        def ready() -> bool:
            if cache.prefetch_ready(handle):
                return True
            cache.poll()
            return False

        assert wait_until(ready, L3_WAIT_S, poll_s=0.001), "prefetch never became ready"
        cache.finish_prefetch(handle)
    return serve(cache, tokens)


def conversation(n: int, seed: int = 0) -> list[int]:
    """Deterministic token ids of a conversation of ``n`` tokens."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]
