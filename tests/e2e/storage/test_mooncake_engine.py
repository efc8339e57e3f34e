"""The engine over a real Mooncake L3: hits across flushes, and a master that dies mid-run.

Whatever L3 does, every request succeeds and its greedy tokens are the ones a
cold run gives: from Mooncake while the master is up, recomputed while it is
down (without waiting on it), and from Mooncake again once it is back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.engine.engine import Engine
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.backends.mooncake.client import WATCH_INTERVAL_S
from hicache.testing.mooncake_master import MasterProcess
from tests.engine_helpers import make_engine_fixture, run  # noqa: F401 - a fixture
from tests.integration.engine.test_engine_cache_reuse import prompt
from tests.integration.engine.test_engine_soak import soak, soak_engine_flags
from tests.l3_engine_checks import (
    FAST_BREAKER,
    assert_hit_after_flush,
    assert_recomputed_while_down,
    assert_stored_and_hit_again,
    l3_engine_flags,
)
from tests.mooncake_fixtures import extra_fixture, master_fixture  # noqa: F401 - fixtures
from tests.waiting import wait_until

# The client's watcher checks the master every WATCH_INTERVAL_S: a guard against a dead
# master that goes unnoticed, generous for a busy machine.
NOTICE_S = 40 * WATCH_INTERVAL_S


def test_engine_outputs_stay_identical_while_the_master_dies_and_returns(
    make_engine: Callable[..., Engine], mooncake_master: MasterProcess,
    mooncake_extra: dict[str, Any],
) -> None:
    engine = make_engine(*l3_engine_flags("mooncake", {**mooncake_extra, **FAST_BREAKER}))
    assert engine.cache.storage is not None, engine.cache.storage_error
    backend = engine.cache.storage.backend
    assert isinstance(backend, MooncakeBackend)

    ids = prompt(11)
    cold = run(engine, ids, ignore_eos=True)
    assert_hit_after_flush(engine, ids, cold.token_ids)  # from Mooncake

    mooncake_master.kill()
    assert wait_until(lambda: not backend.reachable, NOTICE_S), "the dead master went unnoticed"
    assert_recomputed_while_down(engine, ids, cold.token_ids)

    mooncake_master.restart()  # an empty store: the next prompt is stored again, then hit
    assert_stored_and_hit_again(engine)
    engine.check_integrity()


def test_conversations_with_clients_leaving_answer_as_cold_over_mooncake(
    make_engine: Callable[..., Engine], mooncake_extra: dict[str, Any],
) -> None:
    """The engine soak (tests/integration/engine/test_engine_soak.py) with Mooncake as L3."""
    flags = soak_engine_flags(
        "mooncake", mooncake_extra, "write_through", "page_first", "wait_complete"
    )
    soak(make_engine, flags, expect_storage_hits=True)
