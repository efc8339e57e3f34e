"""The load-or-recompute plan: each page boundary priced, the fastest kept, the ends named."""

from __future__ import annotations

import pytest

from hicache.engine.reuse_plan import (
    LOAD_TOLERANCE,
    LOAD_TOLERANCE_S,
    MAX_CANDIDATES,
    CostSnapshot,
    Decision,
    ReuseSituation,
    decision_for,
    plan_reuse,
    price,
)
from hicache.estimators import PrefillCoefficients, attention_pairs

PAGE = 16
# 1 ms a step, 1 ms per token, nothing per pair or decode row: recompute is linear.
LINEAR = PrefillCoefficients(1e-3, 1e-3, 0.0, 0.0)


def costs(load_per_page: float = 1e-3, read_per_page: float | None = None,
          prefill: PrefillCoefficients | None = LINEAR, chunk: int | None = None,
          load_latency: float = 0.0, read_latency: float = 0.0) -> CostSnapshot:
    return CostSnapshot(
        prefill=prefill, chunk_tokens=chunk, load_latency_s=load_latency,
        load_seconds_per_page=load_per_page,
        read_latency_s=None if read_per_page is None else read_latency,
        read_seconds_per_page=read_per_page,
    )


def test_cheap_loads_load_everything_and_dear_loads_recompute() -> None:
    s = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=0, host_tokens=1024)
    # A page loads in 1 ms against 16 ms to compute its tokens: load all.
    plan = plan_reuse(s, costs(load_per_page=1e-3))
    assert plan is not None and plan.decision is Decision.LOAD
    assert plan.cached_tokens == 1024
    assert plan.predicted_s == pytest.approx(64e-3 + 1e-3 + 1e-3)  # loads + one step + 1 token
    # A page loads in 50 ms: computing it again (16 ms) wins.
    plan = plan_reuse(s, costs(load_per_page=50e-3))
    assert plan is not None and plan.decision is Decision.RECOMPUTE
    assert plan.cached_tokens == 0
    assert plan.predicted_s == pytest.approx(1e-3 + 1025e-3)
    assert plan.load_all_s == pytest.approx(64 * 50e-3 + 2e-3)
    assert plan.recompute_s == plan.predicted_s


def test_device_pages_are_never_given_up() -> None:
    s = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=512, host_tokens=512)
    plan = plan_reuse(s, costs(load_per_page=1.0))  # loading is hopeless
    assert plan is not None and plan.decision is Decision.RECOMPUTE
    assert plan.cached_tokens == 512  # the device hit stays
    assert plan.predicted_s == pytest.approx(1e-3 + 513e-3)


def test_no_plan_without_a_known_cost_or_without_anything_to_choose() -> None:
    s = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=0, host_tokens=1024)
    assert plan_reuse(s, costs(prefill=None)) is None
    unknown_load = CostSnapshot(prefill=LINEAR, chunk_tokens=None)
    assert plan_reuse(s, unknown_load) is None
    device_only = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=1024)
    assert plan_reuse(device_only, costs()) is None
    # L3 pages with no read estimate yet: the plan cannot price waiting for them.
    l3 = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=0,
                        found_tokens=1024)
    assert plan_reuse(l3, costs(read_per_page=None)) is None


def test_a_slow_store_cuts_the_prefetch_at_what_landed() -> None:
    # Half of L3's pages have landed; the rest would take 40 ms a page to read, against
    # 16 ms a page to compute: load the landed half, compute the other (a split).
    s = ReuseSituation(prompt_tokens=1025, page_size=PAGE, device_tokens=0,
                       landed_tokens=512, found_tokens=1024)
    plan = plan_reuse(s, costs(load_per_page=1e-3, read_per_page=40e-3))
    assert plan is not None and plan.decision is Decision.SPLIT
    assert plan.cached_tokens == 512
    assert not plan.waits(s)
    assert plan.wait_s == 0.0
    assert plan.predicted_s < min(plan.load_all_s, plan.recompute_s)
    # A fast store: wait for the rest.
    plan = plan_reuse(s, costs(load_per_page=1e-3, read_per_page=1e-3))
    assert plan is not None and plan.decision is Decision.LOAD and plan.waits(s)
    assert plan.wait_s == pytest.approx(32 * 1e-3)


def test_read_latency_alone_can_make_waiting_lose() -> None:
    s = ReuseSituation(prompt_tokens=129, page_size=PAGE, device_tokens=0, found_tokens=128)
    slow = plan_reuse(s, costs(read_per_page=0.0, read_latency=1.0))
    assert slow is not None and slow.decision is Decision.RECOMPUTE
    fast = plan_reuse(s, costs(read_per_page=0.0, read_latency=1e-4))
    assert fast is not None and fast.decision is Decision.LOAD


def test_the_chosen_boundary_is_the_minimum_over_every_page() -> None:
    # A chunked prefill with a dear step makes the recompute a staircase, so the best
    # boundary can sit inside the range; the plan must find the brute-force minimum.
    coef = PrefillCoefficients(0.2, 1e-4, 1e-8, 0.0)
    c = costs(load_per_page=20e-3, prefill=coef, chunk=100, load_latency=1e-3)
    s = ReuseSituation(prompt_tokens=700, page_size=PAGE, device_tokens=32, host_tokens=640)
    plan = plan_reuse(s, c)
    assert plan is not None
    every = [s.device_tokens + i * PAGE for i in range(s.host_tokens // PAGE + 1)]
    best = min(every, key=lambda b: (price(s, c, b) or (0.0, 0.0))[0])
    assert plan.predicted_s == pytest.approx(price(s, c, best)[0])  # type: ignore[index]
    assert plan.decision is Decision.SPLIT  # 608: the last 92 tokens in one chunk
    assert plan.decision is decision_for(plan.cached_tokens, 32, 672)


def test_loading_everything_is_kept_within_the_tolerance() -> None:
    # The same staircase with cheaper loads: the best boundary (608) beats loading all
    # (672) by about 1 ms, under the tolerance: the plan loads everything.
    coef = PrefillCoefficients(0.05, 1e-4, 1e-8, 0.0)
    c = costs(load_per_page=2e-3, prefill=coef, chunk=100, load_latency=1e-3)
    s = ReuseSituation(prompt_tokens=700, page_size=PAGE, device_tokens=32, host_tokens=640)
    plan = plan_reuse(s, c)
    assert plan is not None and plan.decision is Decision.LOAD
    assert price(s, c, 608)[0] < plan.predicted_s  # type: ignore[index]
    assert plan.predicted_s <= price(s, c, 608)[0] * (1 + LOAD_TOLERANCE) + LOAD_TOLERANCE_S  # type: ignore[index]


def test_candidates_are_thinned_but_keep_the_ends() -> None:
    pages = 4 * MAX_CANDIDATES
    s = ReuseSituation(prompt_tokens=pages * PAGE + 1, page_size=PAGE, device_tokens=0,
                       host_tokens=pages * PAGE)
    assert plan_reuse(s, costs(load_per_page=1e-6)).cached_tokens == pages * PAGE  # type: ignore[union-attr]
    assert plan_reuse(s, costs(load_per_page=1.0)).cached_tokens == 0  # type: ignore[union-attr]


def test_a_tie_keeps_the_load() -> None:
    # One page: 16 tokens at 1 ms each against a load of exactly 16 ms.
    s = ReuseSituation(prompt_tokens=17, page_size=PAGE, device_tokens=0, host_tokens=PAGE)
    plan = plan_reuse(s, costs(load_per_page=16e-3))
    assert plan is not None and plan.decision is Decision.LOAD


def test_prices_follow_attention_and_decode_rows() -> None:
    coef = PrefillCoefficients(0.0, 0.0, 1e-6, 1e-3)
    s = ReuseSituation(prompt_tokens=1000, page_size=PAGE, device_tokens=0, host_tokens=512,
                       decode_rows=4)
    c = costs(load_per_page=0.0, prefill=coef)
    seconds, wait = price(s, c, 512)  # type: ignore[misc]
    assert wait == 0.0
    assert seconds == pytest.approx(1e-6 * attention_pairs(488, 512) + 4e-3)


def test_decision_names() -> None:
    assert decision_for(100, 0, 100) is Decision.LOAD
    assert decision_for(0, 0, 100) is Decision.RECOMPUTE
    assert decision_for(32, 32, 100) is Decision.RECOMPUTE
    assert decision_for(64, 32, 100) is Decision.SPLIT
