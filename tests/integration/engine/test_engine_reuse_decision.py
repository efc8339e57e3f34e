"""The load-or-recompute choice (engine/reuse.py) on the tiny engine, with its real
planner and live cost model: no test double decides.

L3 is the ``throttled`` backend over a file store; the host->device path is throttled
with ``hicache.testing.throttled_io``. The cost model is taught as a server would be: cold
prompts teach it the prefill, full hits loaded under policy ``load`` teach it the store's
reads and the host->device loads. Then:

- a hit that a slow path would take far longer to bring than the prompt takes to compute
  is computed again (decision recompute, or a split), in less than the slow path's time,
  and answers with the cold tokens;
- a hit whose first read batch has landed while the rest would take longer to read than
  to compute is split: the landed pages loaded, the rest computed, the cold tokens;
- a hit that loading wins clearly is loaded (decision load); before the model knows a
  cost, a hit is "unpriced" and loaded as before the choice existed; under
  ``--hicache-reuse-policy load`` every hit is loaded whatever it costs;
- a cold prompt is not held for a slow store's lookup once the costs are known.

Every case ends idle with the cache's integrity checked (no host page leaked by a cut
prefetch). Times are asserted only as the throttles' generous bounds: what a throttled
path costs is the feature.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import ReusePolicy
from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.engine.reuse_plan import CostSnapshot, Decision
from hicache.storage.base import MAX_BATCH_PAGES
from hicache.testing.throttled_io import LoadThrottle, throttle_loads, unthrottle_loads
from tests.engine_helpers import Run, collect, on_scheduler, run, wait_idle
from tests.waiting import wait_until, wait_until_async

PAGE = 16
PROMPT = 300  # 18 whole pages, the last token computed anyway
HIT = (PROMPT - 1) // PAGE * PAGE
OUTPUT = 4
# The store's calls and the prefetch wait: far past any read here, so that the policy
# (wait_complete) would hold a request for its whole hit; only the choice cuts it.
PATIENT_WAITS = {"io_timeout_s": 600.0, "prefetch_timeout_max": 600.0, "prefetch_threshold": 1}
# The tiny model computes a PROMPT-token prompt in milliseconds on a CPU; these paths take
# seconds or tenths of one, so the choice is clear however busy the machine is.
SLOW_READ_BANDWIDTH = 100_000  # bytes/s: a 16 KiB page in ~0.16 s, the 18-page hit in ~3 s
SLOW_LOOKUP_MS = 400.0  # every store call's latency (the lookup's included)
SLOW_LOAD = LoadThrottle(latency_s=0.3)  # each host->device load
# A split: the first read batch lands in ~1 s, the rest (200 pages, 3200 tokens the tiny
# model computes in a few tenths of a second) would take ~1.6 s more.
SPLIT_BANDWIDTH = 2_000_000
SPLIT_REST_PAGES = 200


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def store_extra(path: Path, read_latency_ms: float = 0.0, bandwidth: int | None = None
                ) -> dict[str, Any]:
    extra: dict[str, Any] = {
        **PATIENT_WAITS, "backend": "file", "backend_extra": {"path": str(path)},
        "read_latency_ms": read_latency_ms,
    }
    if bandwidth is not None:
        extra["read_bandwidth"] = bandwidth
    return extra


def engine_flags(*extra_flags: str, store: dict[str, Any] | None = None) -> tuple[str, ...]:
    flags = ("--page-size", str(PAGE), "--max-total-tokens", "8192",
             "--enable-hierarchical-cache", *extra_flags)
    if store is None:
        return flags
    return (*flags, "--hicache-storage-backend", "throttled",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(store))


def greedy(engine: Engine, ids: list[int]) -> Run:
    return run(engine, ids, ignore_eos=True, max_new_tokens=OUTPUT)


def set_policy(engine: Engine, policy: ReusePolicy) -> None:
    """Between requests, on the scheduler's thread (the bench switches it so too)."""
    advisor = engine.scheduler.reuse
    on_scheduler(engine, lambda: setattr(advisor, "policy", policy))


def costs(engine: Engine) -> CostSnapshot:
    snapshot = on_scheduler(engine, engine.scheduler.reuse.local_costs)
    assert isinstance(snapshot, CostSnapshot)
    return snapshot


def learn_prefill(engine: Engine) -> None:
    """Cold prompts of several lengths: the prefill estimate needs eight steps."""
    for i in range(10):
        cold = greedy(engine, prompt(1000 + i, 40 + 30 * i))
        assert cold.last.cached_tokens.total == 0
    assert costs(engine).prefill is not None


def learn_loads(engine: Engine, drop: Callable[[], object], seed: int) -> None:
    """Full hits of a few lengths loaded whole (policy load, whatever the engine's own),
    ``drop`` leaving each in the tier it is then loaded from: the cost model learns that
    tier's reads and the host->device loads."""
    policy = engine.scheduler.reuse.policy
    set_policy(engine, ReusePolicy.LOAD)
    try:
        for i, pages in enumerate((2, 3, 4)):
            ids = prompt(seed + i, pages * PAGE + 1)
            cold = greedy(engine, ids)
            drop()
            warm = greedy(engine, ids)
            assert warm.last.cached_tokens.total == pages * PAGE, warm.last.cached_tokens
            assert warm.token_ids == cold.token_ids
    finally:
        set_policy(engine, policy)


def flush(engine: Engine) -> None:
    assert engine.flush_cache()  # waits for the write back to L3: the prompt is in L3 alone


def evict(engine: Engine) -> None:
    assert engine.evict_device_cache() > 0  # the prompt's KV stays in L2 alone


def page_bytes(engine: Engine) -> int:
    assert engine.cache.host_pool is not None
    return int(engine.cache.host_pool.geometry.page_bytes(PAGE))


def settle(engine: Engine) -> None:
    """Idle, with every read a cut prefetch left behind returned and its host pages freed
    (the store keeps reading what it was asked for): then nothing may have leaked."""
    wait_idle(engine)
    storage = engine.cache.storage

    def quiet() -> bool:
        return storage is None or len(storage.held_host_pages()) == 0

    assert wait_until(lambda: on_scheduler(engine, quiet)), "a cut prefetch holds host pages"
    engine.check_integrity()


def assert_recomputed(out: GenerateOutput, hit: int) -> None:
    """The hit was (mostly) not loaded, by choice, and the report says so."""
    report = out.reuse
    assert report is not None
    assert report.decision in (Decision.RECOMPUTE.value, Decision.SPLIT.value), report
    assert report.loaded_tokens < hit and report.recomputed_tokens > 0, report
    assert report.cached_tokens + report.recomputed_tokens == hit, report
    assert report.predicted_recompute_s is not None and report.predicted_load_s is not None
    assert report.predicted_recompute_s < report.predicted_load_s, report
    assert report.actual_s is not None and report.actual_s > 0


@dataclass(frozen=True)
class Prefetch:
    """The queued request's L3 prefetch as a scheduler step left it, in tokens."""

    found: int  # what the lookup found (-1: not answered yet)
    landed: int  # of it, on the host already


def queued_prefetch(engine: Engine) -> Prefetch:
    def take() -> Prefetch:
        waiting = engine.scheduler.waiting_requests()
        handle = waiting[0].prefetch if waiting else None
        if handle is None:
            return Prefetch(-1, 0)
        return Prefetch(handle.num_found_tokens, engine.cache.prefetch_landed_tokens(handle))

    state = on_scheduler(engine, take)
    assert isinstance(state, Prefetch)
    return state


async def queued_behind_a_long_request(
    engine: Engine, ids: list[int], until: Callable[[Prefetch], bool],
) -> tuple[Prefetch, Run]:
    """Run ``ids`` queued behind a long request (one may run at a time) until ``until`` its
    L3 prefetch, then end the long one: the queued request is considered for admission
    then, its choice made knowing what the lookup found and what has landed."""
    params = SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
    long_stream = engine.generate(GenerateRequest(tuple(prompt(99, 40)), params))
    await anext(long_stream)  # it runs, alone
    queued = asyncio.ensure_future(collect(engine, GenerateRequest(
        tuple(ids), SamplingParams(max_new_tokens=OUTPUT, temperature=0.0, ignore_eos=True))))
    state = queued_prefetch(engine)

    def reached() -> bool:
        nonlocal state
        state = queued_prefetch(engine)
        return until(state)

    assert await wait_until_async(reached), state
    await long_stream.aclose()  # ends it: the queued request is considered now
    return state, await queued


def test_a_hit_on_a_store_far_slower_than_compute_is_recomputed_once_costs_are_known(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*engine_flags(
        "--max-running-requests", "1",
        store=store_extra(tmp_path / "l3", read_latency_ms=1.0, bandwidth=SLOW_READ_BANDWIDTH),
    ))
    learn_prefill(engine)
    learn_loads(engine, lambda: flush(engine), seed=2000)
    known = costs(engine)
    assert known.read_latency_s is not None and known.read_seconds_per_page is not None
    hit_read_s = HIT // PAGE * page_bytes(engine) / SLOW_READ_BANDWIDTH  # ~3 s

    ids = prompt(1)
    cold = greedy(engine, ids)
    flush(engine)
    seen, out = asyncio.run(
        queued_behind_a_long_request(engine, ids, lambda p: p.found >= 0))
    assert seen.found == HIT and seen.landed < HIT  # known to be a hit, still reading
    assert out.last.error is None
    assert out.token_ids == cold.token_ids  # computed again: the cold answer
    assert_recomputed(out.last, HIT)
    assert out.last.cached_tokens.storage == out.last.reuse.loaded_tokens
    # The feature's bound: it did not wait for the store's read of the hit.
    assert out.last.ttft_s is not None and out.last.ttft_s < hit_read_s

    # Sent on its own, the hit is not held for the store either: released before the
    # lookup answered (nothing known of a hit, so no report), or after it (the report).
    other = prompt(2)
    other_cold = greedy(engine, other)
    flush(engine)
    alone = greedy(engine, other)
    assert alone.token_ids == other_cold.token_ids
    assert alone.last.ttft_s is not None and alone.last.ttft_s < hit_read_s
    assert alone.last.cached_tokens.storage < HIT
    if alone.last.reuse is not None:
        assert_recomputed(alone.last, HIT)
    settle(engine)


def test_policy_load_loads_a_hit_whatever_it_costs(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*engine_flags(
        "--hicache-reuse-policy", "load",
        store=store_extra(tmp_path / "l3", read_latency_ms=1.0, bandwidth=SLOW_READ_BANDWIDTH),
    ))
    assert engine.cache.config.reuse_policy is ReusePolicy.LOAD
    learn_prefill(engine)
    learn_loads(engine, lambda: flush(engine), seed=2000)
    ids = prompt(1)
    cold = greedy(engine, ids)
    flush(engine)
    warm = greedy(engine, ids)
    assert warm.token_ids == cold.token_ids
    assert warm.last.cached_tokens.storage == HIT
    report = warm.last.reuse
    assert report is not None and report.decision == Decision.LOAD.value, report
    assert report.loaded_tokens == report.cached_tokens == HIT
    # Priced (from admission, the hit on the host by then), and known to lose: reading
    # the hit was priced far above computing it, and it was loaded all the same.
    assert report.predicted_s is not None and report.predicted_recompute_s is not None
    read_s = costs(engine).read_s(HIT // PAGE)
    assert read_s is not None and read_s > report.predicted_recompute_s, report
    # The throttle's wait is the feature: the read of the hit's bytes at its bandwidth.
    hit_read_s = HIT // PAGE * page_bytes(engine) / SLOW_READ_BANDWIDTH
    assert warm.last.ttft_s is not None and warm.last.ttft_s >= hit_read_s
    settle(engine)


def test_a_hit_half_landed_is_split_where_the_rest_computes_faster_than_it_reads(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    # L3 reads a prefetch in batches of MAX_BATCH_PAGES (each lands whole): the first
    # batch lands, the second is still being read at a bandwidth slower than computing
    # its tokens. The choice loads the landed pages and computes the rest.
    landed_pages = MAX_BATCH_PAGES
    hit_pages = landed_pages + SPLIT_REST_PAGES
    length = hit_pages * PAGE + 1
    engine = make_engine(*engine_flags(
        "--max-running-requests", "1", "--max-total-tokens", "16384",
        store=store_extra(tmp_path / "l3", read_latency_ms=1.0, bandwidth=SPLIT_BANDWIDTH),
    ))
    learn_prefill(engine)
    learn_loads(engine, lambda: flush(engine), seed=2000)
    ids = prompt(1, length)
    cold = greedy(engine, ids)
    flush(engine)
    seen, out = asyncio.run(queued_behind_a_long_request(
        engine, ids, lambda p: p.landed >= landed_pages * PAGE))
    assert seen.found == hit_pages * PAGE and seen.landed == landed_pages * PAGE
    assert out.last.error is None
    assert out.token_ids == cold.token_ids  # the split answers as cold
    report = out.last.reuse
    assert report is not None and report.decision == Decision.SPLIT.value, report
    assert report.loaded_tokens == out.last.cached_tokens.storage == landed_pages * PAGE
    assert report.recomputed_tokens == SPLIT_REST_PAGES * PAGE
    assert report.waited_s is not None
    # It did not wait for the second batch: the whole read takes this long at least.
    whole_read_s = hit_pages * page_bytes(engine) / SPLIT_BANDWIDTH
    assert out.last.ttft_s is not None and out.last.ttft_s < whole_read_s
    settle(engine)


def test_a_hit_that_loading_wins_clearly_is_loaded(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*engine_flags(store=store_extra(tmp_path / "l3")))
    learn_prefill(engine)
    learn_loads(engine, lambda: flush(engine), seed=2000)
    long_prompt = 2000
    ids = prompt(1, long_prompt)
    cold = greedy(engine, ids)
    flush(engine)
    warm = greedy(engine, ids)
    hit = (long_prompt - 1) // PAGE * PAGE
    assert warm.token_ids == cold.token_ids
    assert warm.last.cached_tokens.storage == hit
    report = warm.last.reuse
    assert report is not None and report.decision == Decision.LOAD.value, report
    assert report.cached_tokens == report.loaded_tokens == hit and report.recomputed_tokens == 0
    assert report.predicted_s is not None and report.actual_s is not None
    # Clearly: computing 2000 tokens again was priced far above reading and loading them.
    assert report.predicted_recompute_s is not None and report.predicted_load_s is not None
    assert report.predicted_recompute_s > 2 * report.predicted_load_s, report
    settle(engine)


def test_before_the_cost_model_knows_a_hit_is_unpriced_and_loaded(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    engine = make_engine(*engine_flags(store=store_extra(tmp_path / "l3")))
    ids = prompt(1)
    cold = greedy(engine, ids)
    assert cold.last.reuse is None  # nothing cached: nothing to choose
    assert costs(engine).prefill is None  # one prefill step teaches it nothing yet
    flush(engine)
    warm = greedy(engine, ids)
    assert warm.token_ids == cold.token_ids
    assert warm.last.cached_tokens.storage == HIT  # loaded, as before the choice existed
    report = warm.last.reuse
    assert report is not None and report.decision == Decision.UNPRICED.value, report
    assert report.loaded_tokens == HIT and report.recomputed_tokens == 0
    assert report.predicted_s is None and report.predicted_load_s is None
    assert report.predicted_recompute_s is None
    settle(engine)


def test_a_cold_prompt_is_not_held_for_a_slow_lookup_once_costs_are_known(
    make_engine: Callable[..., Engine], tmp_path: Path,
) -> None:
    # The prefill learned with no store (no lookup to wait on), then the store attached.
    engine = make_engine(*engine_flags())
    learn_prefill(engine)
    engine.attach_storage(
        "throttled", store_extra(tmp_path / "l3", read_latency_ms=SLOW_LOOKUP_MS),
        "wait_complete",
    )
    learn_loads(engine, lambda: flush(engine), seed=2000)
    known = costs(engine)
    assert known.read_latency_s is not None and known.read_latency_s >= SLOW_LOOKUP_MS / 1e3
    counters = engine.scheduler.counters
    storage_tokens_before = counters.num_cached_storage_tokens

    fresh = greedy(engine, prompt(3))
    assert fresh.last.error is None
    assert fresh.last.cached_tokens.total == 0 and fresh.last.reuse is None
    # The lookup alone takes SLOW_LOOKUP_MS; computing the prompt, milliseconds.
    assert fresh.last.ttft_s is not None and fresh.last.ttft_s < SLOW_LOOKUP_MS / 1e3
    assert counters.num_cached_storage_tokens == storage_tokens_before
    settle(engine)


def test_a_host_hit_over_a_slow_host_to_device_path_is_recomputed(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*engine_flags())
    controller = engine.cache.controller
    assert controller is not None
    learn_prefill(engine)
    # On the scheduler's thread, between its steps: no load is being issued then.
    on_scheduler(engine, lambda: throttle_loads(controller, SLOW_LOAD))
    try:
        learn_loads(engine, lambda: evict(engine), seed=2000)
        known = costs(engine)
        assert known.load_latency_s is not None
        assert known.load_latency_s + (known.load_seconds_per_page or 0) >= SLOW_LOAD.latency_s / 2
        ids = prompt(1)
        cold = greedy(engine, ids)
        evict(engine)
        warm = greedy(engine, ids)
    finally:
        on_scheduler(engine, lambda: unthrottle_loads(controller))
    assert warm.token_ids == cold.token_ids
    assert_recomputed(warm.last, HIT)
    assert warm.last.cached_tokens.host == warm.last.reuse.loaded_tokens
    # The throttle's wait is the feature: one load would have taken its latency at least.
    assert warm.last.ttft_s is not None and warm.last.ttft_s < SLOW_LOAD.latency_s
    settle(engine)


@pytest.mark.parametrize("policy", [ReusePolicy.COST, ReusePolicy.LOAD])
def test_the_reuse_policy_flag_reaches_the_scheduler(
    make_engine: Callable[..., Engine], policy: ReusePolicy,
) -> None:
    engine = make_engine(*engine_flags("--hicache-reuse-policy", policy.value))
    assert engine.scheduler.reuse.policy is policy
