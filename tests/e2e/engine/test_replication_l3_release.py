"""L3 under tensor parallelism (2 ranks, gloo over loopback; file backend): a flush or a
detach while one rank's L3 call is stalled (past ``io_timeout_s``, still running) keeps
the ranks' caches alike. What the stalled call may still touch stays reserved on that
rank until it returns; every other rank keeps the same host pages reserved and all
free them at the tick the ranks agree the call returned, so free host pages (and with
them evictions) and protected nodes are equal on both ranks at every tick.

A ``set`` stalls while backing up the first requests; a ``get`` stalls while reading
them back from L3 after a flush. The operation under test runs right after, while the
call is still inside the store, and new requests run after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import CacheConfig
from hicache.engine.api import GenerateRequest
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests.ranks import run_ranks
from tests.tp_engine_ranks import (
    L3Fault,
    RankResult,
    Scenario,
    Step,
    greedy,
    prompt,
    run_scenario,
)

VOCAB = 500
PAGE_SIZE = 4
# Every call's deadline: the others (lookups, backups, the other rank's calls) answer far
# within it on a busy machine, so only the late call stalls.
IO_TIMEOUT_S = 2.0
# The late rank's call answers this late, past its deadline: it stalls (still running when
# the deadline passes, with room for a busy machine to notice late).
LATE_CALL_S = IO_TIMEOUT_S + 2.0


def _config(path: Path) -> EngineConfig:
    storage = StorageConfig(
        backend="file", prefetch_threshold=4, backend_extra={"path": str(path)},
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, io_timeout_s=IO_TIMEOUT_S,
    )
    return EngineConfig(
        model=ModelLoadConfig(preset="tiny", device="cpu", dtype="float32"),
        scheduling=SchedulingConfig(max_total_tokens=512),
        cache=CacheConfig(page_size=PAGE_SIZE, enable_hierarchical_cache=True),
        storage=storage,
        parallel=ParallelConfig(tp_size=2),
    )


def _request(rid: str, seed: int, length: int) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt(seed, length, VOCAB), sampling=greedy(), rid=rid)


def _steps(call: str, op: str) -> tuple[Step, ...]:
    cold = (_request("a", 1, 23), _request("b", 2, 30))
    after = Step((_request("c", 3, 26), _request("a-again", 1, 23)))
    if call == "set":  # the first backups stall: the operation runs right after them
        return (Step(cold, op_after=op), after)
    # A flush, then the read back from L3 stalls: the operation runs right after it.
    again = (_request("a-l3", 1, 23), _request("b-l3", 2, 30))
    return (Step(cold, op_after="flush"), Step(again, op_after=op), after)


@pytest.mark.parametrize(
    ("call", "op"),
    [("set", "flush"), ("set", "detach_storage"), ("get", "flush"), ("get", "detach_storage")],
)
def test_an_operation_while_a_rank_call_is_stalled_keeps_the_ranks_alike(
    tmp_path: Path, call: str, op: str
) -> None:
    fault = L3Fault(rank=1, call=call, delay_s=LATE_CALL_S)
    scenario = Scenario(_config(tmp_path), _steps(call, op), l3_fault=fault)
    leader, follower = run_ranks(run_scenario, 2, scenario)
    assert isinstance(leader, RankResult) and isinstance(follower, RankResult)
    assert follower.num_stalled_calls == 1 and leader.num_stalled_calls == 0
    # The operation under test (the last one) ended with rank 1's call still stalled.
    assert follower.stalled_after_ops[-1] == 1 and leader.stalled_after_ops[-1] == 0
    # At every tick, before its agreement: the same free host pages and protected nodes.
    assert leader.free_host_pages == follower.free_host_pages
    assert leader.host_protected_nodes == follower.host_protected_nodes
    assert leader.num_ticks == follower.num_ticks
    # Host pages held outside the tree (a prefetch's, or a flushed backup's), per tick.
    assert leader.reserved_host_pages == follower.reserved_host_pages
    if op == "flush" or call == "get":
        assert max(leader.reserved_host_pages) > 0
    assert leader.num_quarantined_pages == follower.num_quarantined_pages == 0
    assert leader.tree_host_pages == follower.tree_host_pages
    assert leader.num_free_host_pages == follower.num_free_host_pages
    assert leader.tokens == follower.tokens
    assert leader.storage_tokens == follower.storage_tokens
