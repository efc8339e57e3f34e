"""A host hit through the throttled host->device path (hicache.testing.throttled_io) on the
tiny engine: it answers with the tokens a cold run did, and the controller's timing of
its load, what the cost model learns from, includes the throttle's wait."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hicache.engine.engine import Engine
from hicache.testing.throttled_io import (
    LoadThrottle,
    ThrottledIO,
    throttle_loads,
    unthrottle_loads,
)
from tests.engine_helpers import on_scheduler, run

PAGE = 16
TOKENS = 200
LATENCY_S = 0.05
BANDWIDTH = 1e6  # bytes per second: the tiny model's 12 pages (192 KiB) take ~0.2 s


def test_a_throttled_host_hit_answers_as_cold_and_its_load_takes_the_throttles_time(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-hierarchical-cache"
    )
    controller = engine.cache.controller
    assert controller is not None
    original = controller.io
    prompt = torch.randint(0, 256, (TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    cold = run(engine, prompt, max_new_tokens=4)
    assert cold.last.cached_tokens.total == 0
    assert engine.evict_device_cache() > 0  # the prompt's KV stays in L2 only
    # Installed on the scheduler's thread: between its steps, no load is being issued.
    wrapper = on_scheduler(
        engine, lambda: throttle_loads(controller, LoadThrottle(LATENCY_S, BANDWIDTH))
    )
    seconds_before, pages_before = controller.load_seconds, controller.num_loaded_pages
    try:
        warm = run(engine, prompt, max_new_tokens=4)
    finally:
        on_scheduler(engine, lambda: unthrottle_loads(controller))
    assert controller.io is original
    expect = (TOKENS - 1) // PAGE * PAGE  # the page holding the last token is recomputed
    assert warm.last.cached_tokens.host == expect, warm.last.cached_tokens
    assert warm.token_ids == cold.token_ids  # the throttle changes timing only
    loaded_pages = controller.num_loaded_pages - pages_before
    assert loaded_pages == expect // PAGE
    # The feature's lower bound: the load of B bytes took at least latency + B / bandwidth,
    # as the controller timed it on its load thread (its samples feed the cost model).
    assert engine.cache.host_pool is not None
    page_bytes = engine.cache.host_pool.geometry.page_bytes(PAGE)
    floor = LATENCY_S + loaded_pages * page_bytes / BANDWIDTH
    assert isinstance(wrapper, ThrottledIO) and wrapper.waited_s == pytest.approx(floor)
    assert controller.load_seconds - seconds_before >= floor
    # The TTFT that the load made the request wait for includes it too.
    assert warm.last.ttft_s is not None and warm.last.ttft_s >= floor
