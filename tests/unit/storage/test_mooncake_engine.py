"""The engine over a real Mooncake L3: hits across flushes, and a master that dies mid-run.

Whatever L3 does, every request succeeds and its greedy tokens are the ones a
cold run gives: from Mooncake while the master is up, recomputed while it is
down (without waiting on it), and from Mooncake again once it is back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from hicache.engine.engine import Engine
from hicache.storage.mooncake import MooncakeBackend
from hicache.storage.mooncake_client import WATCH_INTERVAL_S
from hicache.storage.mooncake_master import MasterProcess
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.mooncake_fixtures import extra_fixture, master_fixture  # noqa: F401 - fixtures
from tests.unit.engine.test_engine_cache_reuse import PAGE, PROMPT_LEN, prompt
from tests.unit.engine.test_engine_soak import soak, soak_engine_flags

REUSED = (PROMPT_LEN - 1) // PAGE * PAGE
RECOVERY_S = 20.0


def mooncake_flags(extra: dict[str, Any]) -> tuple[str, ...]:
    config = {
        **extra, "prefetch_threshold": 64,
        "breaker_failures": 2, "breaker_backoff_base": 0.2, "breaker_backoff_max": 0.2,
    }
    return (
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )


def test_engine_outputs_stay_identical_while_the_master_dies_and_returns(
    make_engine: Callable[..., Engine], mooncake_master: MasterProcess,
    mooncake_extra: dict[str, Any],
) -> None:
    engine = make_engine(*mooncake_flags(mooncake_extra))
    assert engine.cache.storage is not None, engine.cache.storage_error
    backend = engine.cache.storage.backend
    assert isinstance(backend, MooncakeBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert engine.flush_cache()  # L1 and L2 forget it; Mooncake keeps it
    warm = run(engine, ids, ignore_eos=True)
    assert warm.last.cached_tokens.storage == REUSED
    assert warm.token_ids == cold.token_ids

    mooncake_master.kill()
    deadline = time.monotonic() + 5 * WATCH_INTERVAL_S
    while backend.reachable:
        assert time.monotonic() < deadline, "the dead master went unnoticed"
        time.sleep(0.01)
    for _ in range(3):  # each flush sends the request to L3, which cannot answer
        assert engine.flush_cache()
        began = time.monotonic()
        down = run(engine, ids, ignore_eos=True)
        assert time.monotonic() - began < 2.0  # recomputed, not waiting on the dead master
        assert down.last.finish_reason == "length"
        assert down.last.cached_tokens.total == 0
        assert down.token_ids == cold.token_ids

    mooncake_master.restart()  # an empty store: the next prompt is stored again, then hit
    other = prompt(12)
    other_cold = run(engine, other, ignore_eos=True)
    deadline = time.monotonic() + RECOVERY_S
    while True:
        assert engine.flush_cache()
        back = run(engine, other, ignore_eos=True)
        assert back.token_ids == other_cold.token_ids
        if back.last.cached_tokens.storage == REUSED:
            break
        assert time.monotonic() < deadline, engine.storage_status()
        time.sleep(0.1)
    engine.check_integrity()


def test_conversations_with_clients_leaving_answer_as_cold_over_mooncake(
    make_engine: Callable[..., Engine], mooncake_extra: dict[str, Any],
) -> None:
    """The engine soak (tests/unit/engine/test_engine_soak.py) with Mooncake as L3."""
    flags = soak_engine_flags(
        "mooncake", mooncake_extra, "write_through", "page_first", "wait_complete"
    )
    soak(make_engine, flags, expect_storage_hits=True)
