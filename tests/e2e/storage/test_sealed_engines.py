"""Engines over a real redis-server and a real mooncake_master with --l3-encryption-keys:
per tenant, a page read back from the store answers as a cold run, a second engine with the
same key file hits the pages the first stored, and the store holds only sealed pages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.frame import SEALED_FORMAT_VERSION, SEALED_HEADER_BYTES
from tests.engine_helpers import (  # noqa: F401 - make_engine_fixture: a fixture
    Run,
    collect,
    make_engine_fixture,
)
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.l3_engine_checks import REUSED, l3_engine_flags
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    anchor_fixture,
    extra_fixture,
    master_fixture,
)
from tests.redis_fixtures import extra_fixture as redis_extra_fixture  # noqa: F401
from tests.redis_fixtures import server_fixture  # noqa: F401 - a fixture

KEYS = f"acme 1 {'a1' * 32}\nacme 2 {'a2' * 32}\n* 1 {'5e' * 32}\n"
TENANTS = ("acme", None)


def ask(engine: Engine, ids: list[int], tenant: str | None) -> Run:
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    return asyncio.run(collect(engine, GenerateRequest(tuple(ids), params, extra_key=tenant)))


def sealed_flags(backend: str, extra: dict[str, Any], keys: Path) -> tuple[str, ...]:
    return (*l3_engine_flags(backend, extra), "--hicache-reuse-policy", "load",
            "--l3-encryption-keys", str(keys))


def check_shared_sealed_store(
    make_engine: Callable[..., Engine], flags: tuple[str, ...], seed: int
) -> None:
    """Cold, then hit after a flush, then hit from a second engine, per tenant."""
    engine = make_engine(*flags)
    assert engine.cache.storage is not None, engine.cache.storage_error
    ids = prompt(seed)
    cold = {tenant: ask(engine, ids, tenant).token_ids for tenant in TENANTS}
    assert engine.flush_cache()
    for tenant in TENANTS:
        warm = ask(engine, ids, tenant)
        assert warm.last.cached_tokens.storage == REUSED, tenant
        assert warm.token_ids == cold[tenant], tenant
    assert not engine.cache.storage.backend.stats().failures
    twin = make_engine(*flags)
    for tenant in TENANTS:
        shared = ask(twin, ids, tenant)
        assert shared.last.cached_tokens.storage == REUSED, tenant
        assert shared.token_ids == cold[tenant], tenant


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return path


def assert_sealed(values: list[bytes]) -> None:
    assert values
    for value in values:
        header = value[-SEALED_HEADER_BYTES:]
        assert header[:4] == b"HCKV" and header[4] == SEALED_FORMAT_VERSION


def test_engines_share_sealed_pages_over_redis(
    make_engine: Callable[..., Engine], redis_extra: dict[str, Any], key_file: Path,
) -> None:
    check_shared_sealed_store(make_engine, sealed_flags("redis", redis_extra, key_file), 31)
    client = redis.Redis.from_url(redis_extra["url"])
    try:
        names = list(client.scan_iter(match=redis_extra["prefix"].encode() + b"*"))
        assert_sealed([bytes(client.get(name)) for name in names])
    finally:
        client.close()


def test_engines_share_sealed_pages_over_mooncake(
    make_engine: Callable[..., Engine], mooncake_extra: dict[str, Any],
    mooncake_anchor: MooncakeBackend, key_file: Path,
) -> None:
    check_shared_sealed_store(
        make_engine, sealed_flags("mooncake", mooncake_extra, key_file), 32
    )
