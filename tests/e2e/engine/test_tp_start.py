"""A tensor-parallel group whose start-up fails on one rank only (2 ranks, gloo over
loopback) fails as a whole, at once, with that rank's reason: every rank's build ends
in an agreed "ready or failed" (``engine/start_agreement.py``), so no rank waits in a
collective for a peer that gave up, and rank 0 never reports ready without it. A store
that only one rank cannot reach at start leaves every rank without L3 (as one rank
alone starts without it), never one rank with L3 and the other without.

Rank 1's faults: its weights fail to load (before the ranks agree on the pools' sizes),
its L3 store fails to attach (``tests/tp_start_faults.py``), or it fails
before joining the group at all (then its process reports why to the server).
"""

from __future__ import annotations

import time

import pytest

from hicache.config import CacheConfig
from hicache.distributed.group import DEFAULT_TIMEOUT_S
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.engine.engine_client import EngineClient, EngineStartError
from hicache.engine.start_agreement import RankOutcome, failure_message
from hicache.storage.config import StorageConfig
from tests import tp_start_faults
from tests.ranks import COLLECTIVE_TIMEOUT_S, run_ranks
from tests.tp_start_faults import (
    ATTACH_FAULT,
    JOIN_FAULT,
    WEIGHTS_FAULT,
    BuildOutcome,
)

# What the start agreement saves: without it a rank would wait in its next collective for
# the group's timeout (COLLECTIVE_TIMEOUT_S, 120 s, under run_ranks; DEFAULT_TIMEOUT_S, 300 s,
# for an EngineClient's ranks). Building the tiny model's rank takes about a second on a quiet
# machine and tens of seconds on a loaded one: the bound sits between the two, generous under
# load and still failed by a rank that waits for a timeout.
FAILS_WITHIN_S = 0.75 * min(COLLECTIVE_TIMEOUT_S, DEFAULT_TIMEOUT_S)
# Spawning two interpreters and building both ranks: a hang guard, far above any real start.
START_TIMEOUT_S = DEFAULT_TIMEOUT_S


def _config(storage_unavailable: bool | None = None) -> EngineConfig:
    """tp 2 on the tiny preset; with ``storage_unavailable`` not None, an L3 store that
    rank 1 cannot attach (unreachable, or misconfigured)."""
    storage = StorageConfig()
    if storage_unavailable is not None:
        storage = StorageConfig(
            backend="dynamic", backend_extra=tp_start_faults.storage_extra(storage_unavailable)
        )
    return EngineConfig(
        model=ModelLoadConfig(preset="tiny", device="cpu"),
        scheduling=SchedulingConfig(max_total_tokens=512),
        cache=CacheConfig(page_size=4, enable_hierarchical_cache=True),
        storage=storage,
        parallel=ParallelConfig(tp_size=2),
    )


def test_rank_one_failing_to_load_its_weights_fails_every_rank_at_once() -> None:
    outcomes = run_ranks(
        tp_start_faults.build_rank, 2, (_config(), True)
    )
    reason = f"tensor-parallel rank 1 could not start: OSError: {WEIGHTS_FAULT}"
    for outcome in outcomes:
        assert isinstance(outcome, BuildOutcome)
        assert outcome.error == f"RankStartError: {reason}"
        assert outcome.seconds < FAILS_WITHIN_S


def test_rank_one_failing_to_attach_l3_fails_the_engine_start_with_its_reason() -> None:
    client = EngineClient(_config(storage_unavailable=False), start_timeout_s=START_TIMEOUT_S)
    began = time.monotonic()
    with pytest.raises(EngineStartError) as failure:
        client.start()
    assert time.monotonic() - began < FAILS_WITHIN_S
    assert str(failure.value) == (
        f"tensor-parallel rank 1 could not start: StorageError: {ATTACH_FAULT}"
    )
    for process in [client._process, *client._followers]:  # every rank is gone
        assert process is not None and not process.is_alive()


def test_a_store_rank_one_cannot_reach_leaves_every_rank_without_l3() -> None:
    outcomes = run_ranks(
        tp_start_faults.build_rank, 2, (_config(storage_unavailable=True), False)
    )
    for outcome in outcomes:
        assert isinstance(outcome, BuildOutcome)
        assert outcome.error is None
        assert not outcome.l3_attached
        assert outcome.l3_error == f"tensor-parallel rank 1: {ATTACH_FAULT}"


def test_rank_one_failing_before_joining_the_group_fails_the_engine_start_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("hicache.engine.engine_client.run_follower_process",
                        tp_start_faults.follower_failing_before_the_group)
    client = EngineClient(_config(), start_timeout_s=START_TIMEOUT_S)
    began = time.monotonic()
    with pytest.raises(EngineStartError) as failure:
        client.start()  # rank 0 waits in the group's rendezvous meanwhile
    assert time.monotonic() - began < FAILS_WITHIN_S
    assert str(failure.value) == f"tensor-parallel rank 1 could not start: OSError: {JOIN_FAULT}"
    for process in [client._process, *client._followers]:
        assert process is not None and not process.is_alive()


def test_ranks_that_failed_alike_are_named_together() -> None:
    failed = [RankOutcome(0, "ConfigError: bad flag", None), RankOutcome(1, "OSError: disk", None),
              RankOutcome(2, "ConfigError: bad flag", None)]
    assert failure_message(failed) == (
        "tensor-parallel ranks 0, 2 could not start: ConfigError: bad flag; "
        "tensor-parallel rank 1 could not start: OSError: disk"
    )
