"""A real Mooncake Store for tests: a mooncake_master per test module, on loopback, free ports.

Test modules import the fixtures they use; each is registered under the
name a test asks for (``mooncake_master``, ``mooncake_extra``, ``mooncake_anchor``)::

    from tests.mooncake_fixtures import extra_fixture, master_fixture  # noqa: F401

Importing this module fails the importing test module (with the reason) when
the ``mooncake`` client cannot be imported here: the package is missing, or a
system library it links against is (libibverbs, librdmacm, libnuma). It is a
declared dev dependency (``tests/dev_dependency.py``).

The Mooncake client listens on every interface (ports 15000-17000); the
session's private network namespace (tests/network_namespace.py) leaves it only
loopback. Where the session could not get one, the master fixture warns.

Backends with equal settings share one Mooncake client per process, and
closing a client takes the library a second or two; ``mooncake_anchor`` keeps
one backend attached for a whole module so the tests in it do not each pay
for a new client.

``peer_main`` is a second process for cross-process tests: a cache attached to
the same master, driven by commands on stdin (see its docstring).
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dev_dependency import require_dev_dependency

require_dev_dependency(
    "mooncake.store",
    "pip install 'hicache[mooncake]' and, on Debian/Ubuntu, apt-get install libibverbs1 "
    "librdmacm1 libnuma1 (scripts/bootstrap.sh does both)",
)

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.testing.mooncake_master import MasterProcess, start_master
from tests.kv_oracle import conversation, serve_with_l3, settle
from tests.l3_caches import make_l3_cache
from tests.network_namespace import enter_private_network

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
WAIT_S = 10.0
# Small client memory: test pages are a few hundred bytes.
CLIENT_SIZES = {"global_segment_size": "32MiB", "local_buffer_size": "4MiB"}


@pytest.fixture(scope="module", name="mooncake_master")
def master_fixture() -> Iterator[MasterProcess]:
    """A master on 127.0.0.1 (RPC and metrics ports free ones), stopped after the module."""
    isolation = enter_private_network()  # the session's, entered by tests/conftest.py
    if not isolation.private:
        warnings.warn(f"Mooncake tests run on {isolation.note}", UserWarning, stacklevel=1)
    with start_master() as master:
        yield master


@pytest.fixture(scope="module", name="mooncake_extra")
def extra_fixture(mooncake_master: MasterProcess) -> dict[str, Any]:
    """The backend extra config that reaches the module's master."""
    return {"master_server_address": mooncake_master.address, **CLIENT_SIZES}


@pytest.fixture(scope="module", name="mooncake_anchor")
def anchor_fixture(mooncake_extra: dict[str, Any]) -> Iterator[MooncakeBackend]:
    """A backend attached for the whole module: holds the shared client (and gives raw access)."""
    host = HostPool(GEOMETRY, 4, 1, MemLayout.PAGE_FIRST, pin_memory=False)
    backend = MooncakeBackend(mooncake_extra)
    backend.attach(host)
    yield backend
    backend.close()


# ------------------------------------------------------------------ caches
def make_cache(
    extra: dict[str, Any], *, page_size: int = 4, layout: MemLayout = MemLayout.PAGE_FIRST,
    device_pages: int = 64, **storage: Any,
) -> HierarchicalCache:
    """A write-through cache with L3 on Mooncake (through the registry, as a server does)."""
    return make_l3_cache(
        "mooncake", extra, GEOMETRY, page_size=page_size, layout=layout,
        device_pages=device_pages, **storage,
    )





# ------------------------------------------------------------------ a peer process
def peer_main() -> None:
    """A cache in its own process on the master given as argv[1]; commands on stdin.

    ``serve SEED N``: serve ``conversation(N, SEED)``, settle, answer
    ``{"hit": tokens reused, "storage_hit": tokens from L3, "backed_up": pages}``;
    ``quit``: close and exit. Every answer is one JSON line on stdout; the first
    one, ``{"ready": true}``, says the cache is attached.
    """
    extra = {"master_server_address": sys.argv[1], **CLIENT_SIZES}
    cache = make_cache(extra)
    assert cache.storage is not None, cache.storage_error
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            assert command[0] == "serve", command
            hit = serve_with_l3(cache, conversation(int(command[2]), int(command[1])))
            settle(cache)
            answer = {
                "hit": hit, "storage_hit": cache.stats.num_storage_hit_tokens,
                "backed_up": cache.stats.num_storage_backed_up_pages,
            }
            print(json.dumps(answer), flush=True)
    finally:
        cache.close()
