"""The throttled L3 under the cache and the engine: it changes when pages arrive, never
which.

Over a file store: every page a new cache reuses through the throttle equals cold KV (the
KV oracle), an engine's output from L3 after a flush of L1 and L2 equals its cold output,
and a delay longer than the call deadline is what a slow real store's is: the call stalls,
is counted and left behind, the breaker opens, the request recomputes (the same output),
and the late return is seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import MemLayout
from hicache.engine.engine import Engine
from hicache.memory.geometry import KVGeometry
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.throttled.backend import ThrottledBackend
from tests.engine_helpers import make_engine_fixture, on_scheduler, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.kv_oracle import conversation
from tests.l3_caches import assert_a_new_cache_reuses, l3_backend_of, make_l3_cache
from tests.l3_engine_checks import assert_hit_after_flush, l3_engine_flags
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
READ_LATENCY_MS = 20.0
# A delay far past the call deadline, yet short enough to wait for its late return.
IO_TIMEOUT_S = 0.5
STALL_LATENCY_MS = 3000.0
# Compute and scheduling on a machine busy with other work: a request that waited out the
# stall (3 s) would still be under it, but one that waited on a hung store never finishes.
MARGIN_S = 30.0
SETTLE_S = 60.0


def throttled_file(path: Path, **delays: Any) -> dict[str, Any]:
    return {"backend": "file", "backend_extra": {"path": str(path)}, **delays}


@pytest.mark.parametrize("layout", list(MemLayout))
def test_a_new_cache_reuses_the_kv_stored_through_the_throttle(
    tmp_path: Path, layout: MemLayout
) -> None:
    extra = throttled_file(
        tmp_path / "l3", read_latency_ms=2, read_bandwidth="100MB", write_latency_ms=1
    )

    def make_cache() -> Any:
        cache = make_l3_cache("throttled", extra, GEOMETRY, layout=layout)
        assert isinstance(l3_backend_of(cache, ThrottledBackend).inner, FileBackend)
        return cache

    assert_a_new_cache_reuses(make_cache, conversation(40))


def test_engine_outputs_through_the_throttle_equal_cold(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    extra = throttled_file(
        tmp_path / "l3", read_latency_ms=READ_LATENCY_MS, read_bandwidth="200MB",
        write_latency_ms=5, write_bandwidth="1GiB",
    )
    engine = make_engine(*l3_engine_flags("throttled", extra))
    assert engine.cache.storage is not None, engine.cache.storage_error
    backend = engine.cache.storage.backend
    assert isinstance(backend, ThrottledBackend) and isinstance(backend.inner, FileBackend)

    ids = prompt(21)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from the files, through the throttle
    stats = backend.stats()
    assert stats.pages_read > 0 and stats.failures == {}
    # The reads waited: their time, as the caller saw it, holds the latency (the feature).
    assert stats.read_seconds >= READ_LATENCY_MS / 1000
    engine.check_integrity()


def test_a_delay_past_the_call_deadline_is_a_stall_and_the_request_recomputes(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    extra = throttled_file(
        tmp_path / "l3", read_latency_ms=STALL_LATENCY_MS,
        io_timeout_s=IO_TIMEOUT_S, breaker_backoff_base=0.2, breaker_backoff_max=0.2,
    )
    engine = make_engine(*l3_engine_flags("throttled", extra))
    storage = engine.cache.storage
    assert storage is not None, engine.cache.storage_error

    ids = prompt(21)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()
    began = time.monotonic()
    slow = run(engine, ids, ignore_eos=True)
    assert time.monotonic() - began < IO_TIMEOUT_S + MARGIN_S
    assert slow.token_ids == cold.token_ids
    assert slow.last.cached_tokens.storage == 0  # recomputed: the store was too slow

    def stalled() -> bool:
        metrics = storage.metrics()
        return metrics.failures.get("timeout", 0) >= 1 and storage.breaker.num_opened >= 1

    assert wait_until(lambda: on_scheduler(engine, stalled), SETTLE_S), storage.metrics()
    # The throttle's wait ends: the abandoned call returns, as a slow store's would.
    assert wait_until(
        lambda: on_scheduler(engine, lambda: storage.metrics().stalled_calls == 0), SETTLE_S
    ), storage.metrics()
    engine.check_integrity()
