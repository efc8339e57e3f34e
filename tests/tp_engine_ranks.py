"""What each rank does in the replicated-scheduler tests (spawned ranks import this
module, not the test, which imports transformers).

``run_scenario`` builds a rank's engine without its scheduler thread and drives it by
hand: rank 0 queues each step's requests and ticks the replicated scheduler until they
finish, running a cache operation between steps; the followers run ``run_replica``.
Given ``SINGLE_RANK`` it drives one plain scheduler the same way (the reference). A
``Scenario`` may make one rank's L2 copies look late for its first ticks (a fault on
that rank alone), as a slow copy engine would, or one rank's L3 store find or return
fewer pages than it holds, or answer its reads late (``L3Fault``), as a store missing or
failing pages, or a slow or hung one, would.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.distributed.group import TPGroup
from hicache.engine.api import GenerateRequest, Hint, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.cache_ops import CACHE_OPS
from hicache.engine.config import EngineConfig
from hicache.engine.engine import Engine
from hicache.engine.replication import AddRequest, Progress
from hicache.engine.request import Phase, Req
from hicache.memory.allocator import PageIds

MAX_TICKS = 2000
IDLE_TICK_S = 0.001


@dataclass(frozen=True)
class Step:
    """Requests queued together, then a cache operation (or None) once they finished."""

    requests: tuple[GenerateRequest, ...]
    op_after: str | None = None
    # Prefixes warmed from L3 into L2 after ``op_after`` (``cache/warm.py``), stepped until
    # done; their outcomes go to ``RankResult.warm_results``.
    warm_after: tuple[tuple[int, ...], ...] = ()
    # Hints applied after ``op_after`` (``cache/hints.py``, the ``hints_apply`` operation);
    # their outcomes go to ``RankResult.hint_results``.
    hints_after: tuple[Hint, ...] = ()


@dataclass(frozen=True)
class Scenario:
    config: EngineConfig
    steps: tuple[Step, ...]
    lagging_rank: int | None = None  # whose landed L2 writes read 0 for ``lag_ticks`` ticks
    lag_ticks: int = 0
    l3_fault: L3Fault | None = None


@dataclass(frozen=True)
class L3Fault:
    """Rank ``rank``'s L3 backend reports ``num_pages`` fewer pages than it has, in its
    lookups (``exists``) or its reads (``get``: the pages past the count are not verified);
    with ``delay_s`` its first ``num_delayed_calls`` calls (``get`` or ``set``) answer that
    late instead."""

    rank: int
    call: str  # "exists" | "get" | "set" (with delay_s)
    num_pages: int = 2
    delay_s: float = 0.0
    num_delayed_calls: int = 1


@dataclass
class RankResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # each request's output
    cached: dict[str, tuple[int, int]] = field(default_factory=dict)  # (device, host) tokens
    storage_tokens: dict[str, int] = field(default_factory=dict)  # what L3 gave each request
    agreed: list[int] = field(default_factory=list)  # per tick: agreed landed writes
    observed: list[int] = field(default_factory=list)  # per tick: this rank's own count
    # Per tick, before its agreement: L2 writes not acknowledged yet (what earlier ticks'
    # agreed acknowledgements left; must be the same on every rank at every tick).
    unacknowledged: list[int] = field(default_factory=list)
    # Per tick, before its agreement: free host pages, and tree nodes whose host copy is
    # protected (in use by L3, so not evictable); alike on every rank at every tick.
    free_host_pages: list[int] = field(default_factory=list)
    host_protected_nodes: list[int] = field(default_factory=list)
    # Per tick, before its agreement: host pages neither free nor in the tree (held for
    # L3: prefetches, stalled calls, backups awaiting agreement); alike on every rank.
    reserved_host_pages: list[int] = field(default_factory=list)
    tree_device_pages: list[int] = field(default_factory=list)
    tree_host_pages: list[int] = field(default_factory=list)
    num_free_device_pages: int = 0
    num_free_host_pages: int = 0
    num_ticks: int = 0
    num_stalled_calls: int = 0  # L3 calls that went past their deadline (io_timeout_s)
    num_quarantined_pages: int = 0  # host pages still reserved for stalled calls at the end
    l3_put_keys: list[bytes] = field(default_factory=list)  # every key this rank wrote to L3
    # This rank's L3 calls stalled (not returned) as each cache operation ended, in order.
    stalled_after_ops: list[int] = field(default_factory=list)
    # Per Step.warm_after, on rank 0 (or alone): the warm's outcomes.
    warm_results: list[list[dict[str, Any]]] = field(default_factory=list)
    # Per Step.hints_after, on rank 0 (or alone): the hints' outcomes.
    hint_results: list[list[dict[str, Any]]] = field(default_factory=list)
    # Per tick, before its agreement: pinned and retained pages (alike on every rank).
    hinted_pages: list[tuple[int, int]] = field(default_factory=list)


def greedy(max_new_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def run_scenario(tp: TPGroup, scenario: Scenario) -> RankResult:
    engine = build_engine(scenario.config, tp, start=False)
    try:
        tier = engine.cache.storage  # read at the end even if a step detached it
        result = _drive(engine, tp, scenario)
        cache = engine.cache  # the tree as the agreed acknowledgements left it
        if tier is not None:
            result.num_stalled_calls = tier.metrics().failures.get("timeout", 0)
            result.num_quarantined_pages = tier.num_quarantined_pages
        result.tree_device_pages = sorted(int(p) for p in cache.tree.device_page_ids())
        result.tree_host_pages = sorted(int(p) for p in cache.tree.host_page_ids())
        result.num_free_device_pages = cache.device_pool.allocator.num_free_pages
        assert cache.host_pool is not None
        result.num_free_host_pages = cache.host_pool.allocator.num_free_pages
        CACHE_OPS["check_integrity"](engine.scheduler)  # the group has stopped: rank-local
        return result
    finally:
        engine.shutdown()


def _inject_l3_fault(engine: Engine, fault: L3Fault) -> None:
    storage = engine.cache.storage
    assert storage is not None, "an L3 fault needs L3"
    backend = storage.backend
    if fault.delay_s > 0:
        late_call = getattr(backend, fault.call)
        num_calls = [0]

        def slow(keys: Sequence[bytes], host_pages: PageIds) -> Any:
            num_calls[0] += 1
            if num_calls[0] <= fault.num_delayed_calls:
                time.sleep(fault.delay_s)  # the injected fault: a late store call
            return late_call(keys, host_pages)

        setattr(backend, fault.call, slow)
    elif fault.call == "exists":
        real_exists = backend.exists

        def exists(keys: Sequence[bytes]) -> int:
            return max(0, real_exists(keys) - fault.num_pages)

        backend.exists = exists  # type: ignore[method-assign]
    else:
        real_get = backend.get

        def get(keys: Sequence[bytes], host_pages: PageIds) -> int:
            return max(0, real_get(keys, host_pages) - fault.num_pages)

        backend.get = get  # type: ignore[method-assign]


def _count_l3_puts(engine: Engine, result: RankResult) -> None:
    storage = engine.cache.storage
    if storage is None:
        return
    backend = storage.backend
    real_set = backend.set

    def counted_set(keys: Sequence[bytes], host_pages: PageIds) -> int:
        result.l3_put_keys.extend(keys)
        return real_set(keys, host_pages)

    backend.set = counted_set  # type: ignore[method-assign]


def _record_stalls_after_ops(engine: Engine, result: RankResult) -> None:
    """Record, as each cache operation that changes the cache ends on this rank, its L3
    calls then stalled (a flush or a detach waits for the calls in flight up to their
    deadline; not the integrity checks, which run at the end too)."""
    tier = engine.cache.storage
    if tier is None:
        return
    for name, op in list(CACHE_OPS.items()):
        if name == "check_integrity" or name.startswith("warm_"):  # a warm: many steps
            continue
        def recorded(scheduler: Any, *args: Any, op: Any = op) -> Any:
            value = op(scheduler, *args)
            result.stalled_after_ops.append(tier.controller.num_stalled_calls)
            return value

        CACHE_OPS[name] = recorded  # this rank's process only


def _drive(engine: Engine, tp: TPGroup, scenario: Scenario) -> RankResult:
    result = RankResult()
    _count_l3_puts(engine, result)
    _record_stalls_after_ops(engine, result)
    if scenario.l3_fault is not None and scenario.l3_fault.rank == tp.rank:
        _inject_l3_fault(engine, scenario.l3_fault)
    replicated = engine.replicated
    if replicated is not None:
        replicated.record = True
        real = replicated.observe

        controller = engine.cache.controller
        assert controller is not None
        host_pool = engine.cache.host_pool

        def observe() -> Progress:
            result.unacknowledged.append(controller.num_pending_writes)
            if host_pool is not None:
                free = host_pool.allocator.num_free_pages
                result.free_host_pages.append(free)
                in_tree = len(engine.cache.tree.host_page_ids())
                result.reserved_host_pages.append(host_pool.num_pages - free - in_tree)
                result.host_protected_nodes.append(
                    sum(node.host_ref > 0 for node in engine.cache.tree.iter_nodes())
                )
            tree = engine.cache.tree
            result.hinted_pages.append((tree.num_pinned_pages, tree.num_retained_pages))
            seen = real()
            result.observed.append(seen.num_landed_writes)
            if tp.rank == scenario.lagging_rank and replicated.num_ticks < scenario.lag_ticks:
                # Its copies look late: the group must wait for it.
                return dataclasses.replace(seen, num_landed_writes=0)
            return seen

        replicated.observe = observe
        if tp.rank != 0:
            made: list[Req] = []
            make_req = replicated.make_req

            def keep(add: AddRequest) -> Req:
                made.append(make_req(add))
                return made[-1]

            replicated.make_req = keep
            engine.run_replica()  # until rank 0 stops the group
            result.tokens = {req.rid: list(req.output_ids) for req in made}
            result.storage_tokens = {req.rid: req.storage_tokens for req in made}
            result.agreed = [p.num_landed_writes for p in replicated.agreed]
            result.num_ticks = replicated.num_ticks
            return result
    scheduler = engine.scheduler
    stop = threading.Event()

    def tick() -> None:
        worked = scheduler.step() if replicated is None else replicated.tick(stop)[1]
        if not worked:
            time.sleep(IDLE_TICK_S)  # waiting on a thread (an L3 lookup or read): let it run

    def run_op(name: str, *args: Any) -> Any:
        if replicated is None:
            return CACHE_OPS[name](scheduler, *args)
        future = scheduler.call_op(name, *args)
        tick()
        return future.result(timeout=0)

    for step in scenario.steps:
        reqs = [engine._replica_req(AddRequest(r, r.rid or "", None, time.monotonic()))
                for r in step.requests]
        for req in reqs:
            scheduler.submit(req)
        for _ in range(MAX_TICKS):
            if all(req.phase is Phase.FINISHED for req in reqs):
                break
            tick()
        _record(result, reqs)
        if step.op_after is not None:
            run_op(step.op_after)
        if step.warm_after:
            items = [list(p) for p in step.warm_after]
            progress = run_op("warm_start", "w", items, 1.0)
            for _ in range(MAX_TICKS):
                if progress["done"]:
                    break
                tick()
                progress = run_op("warm_step", "w")
            assert progress["done"], "the warm never settled"
            result.warm_results.append(progress["results"])
        if step.hints_after:
            outcomes = run_op("hints_apply", list(step.hints_after))
            result.hint_results.append([outcome.as_dict() for outcome in outcomes])
    if replicated is not None:
        # Prefetches still draining (a rank's read not returned) and backups not agreed
        # (a detached tier's too) settle on every rank before the group stops: a decision
        # on agreed state, so every rank ticks alike.
        for _ in range(MAX_TICKS):
            if not engine.cache.l3_awaits_agreement:
                break
            tick()
        stop.set()
        stopping, _ = replicated.tick(stop)
        assert stopping
        result.agreed = [p.num_landed_writes for p in replicated.agreed]
        result.num_ticks = replicated.num_ticks
    return result


def _record(result: RankResult, reqs: list[Req]) -> None:
    for req in reqs:
        assert req.phase is Phase.FINISHED and req.error is None, (req.rid, req.error)
        result.tokens[req.rid] = list(req.output_ids)
        result.cached[req.rid] = (req.cached.device, req.cached.host)
        result.storage_tokens[req.rid] = req.storage_tokens


def prompt(seed: int, length: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, vocab, length))
