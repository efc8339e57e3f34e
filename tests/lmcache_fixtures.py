"""A real LMCache server for tests: one ``lmcache_server`` per test module, on a free loopback port.

Test modules import the fixtures they use (registered under the names tests ask for)::

    from tests.lmcache_fixtures import extra_fixture, server_fixture  # noqa: F401

The server runs from LMCache's own environment (``.venv-lmcache``, made by
``scripts/bootstrap.sh``); importing this module fails the importing test
module when it cannot be found (``tests/dev_dependency``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.storage.backends.lmcache.backend import LMCacheBackend
from hicache.testing.lmcache_server import (
    INSTALL_HINT,
    LMCacheServerProcess,
    find_server_program,
    start_server,
)
from tests.dev_dependency import require_found
from tests.l3_caches import l3_backend_of, make_l3_cache

PROGRAM: Path = require_found("program 'lmcache_server'", find_server_program(), INSTALL_HINT)
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


@pytest.fixture(scope="module", name="lmcache_server")
def server_fixture() -> Iterator[LMCacheServerProcess]:
    """A server on 127.0.0.1 for the whole module, killed after it."""
    with start_server(program=PROGRAM) as server:
        yield server


@pytest.fixture(scope="module", name="lmcache_extra")
def extra_fixture(lmcache_server: LMCacheServerProcess) -> dict[str, Any]:
    """The backend extra config that reaches the module's server."""
    return {"remote_url": lmcache_server.url}


def make_cache(
    extra: dict[str, Any], *, page_size: int = 4, layout: MemLayout = MemLayout.PAGE_FIRST,
    device_pages: int = 64, **storage: Any,
) -> HierarchicalCache:
    """A write-through cache with L3 on LMCache, built by name through the registry."""
    cache = make_l3_cache(
        "lmcache", extra, GEOMETRY, page_size=page_size, layout=layout,
        device_pages=device_pages, **storage,
    )
    backend_of(cache)  # it attached, and is LMCache
    return cache


def backend_of(cache: HierarchicalCache) -> LMCacheBackend:
    return l3_backend_of(cache, LMCacheBackend)
