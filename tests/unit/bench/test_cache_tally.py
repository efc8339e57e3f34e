"""The cached share of a set of requests and the ratios between two sets: raw sums."""

from __future__ import annotations

import pytest

from hicache.bench.cache_tally import CacheTally, ratio
from hicache.bench.report import RequestRecord


def record(prompt: int, cached: int | None, by_tier: dict[str, int] | None,
           ok: bool = True) -> RequestRecord:
    return RequestRecord(
        session=0, round=0, group=0, sent_s=0.0, ok=ok, latency_s=1.0, ttft_s=0.1,
        ttft_from_content=True, itl_s=[], prompt_tokens=prompt, output_tokens=4,
        cached_tokens=cached, cached_by_tier=by_tier,
    )


def test_only_successful_requests_count_towards_the_token_sums() -> None:
    tally = CacheTally.of([
        record(100, 60, {"device": 30, "host": 20, "storage": 10}),
        record(300, 100, {"device": 0, "host": 0, "storage": 100}),
        record(50, None, None),  # the server did not say: nothing cached counted
        record(1000, 1000, {"device": 1000, "host": 0, "storage": 0}, ok=False),
    ])
    assert (tally.requests, tally.failed) == (4, 1)
    assert (tally.prompt_tokens, tally.cached_tokens) == (450, 160)
    assert tally.cached_by_tier == {"device": 30, "host": 20, "storage": 110}
    assert tally.cached_share == pytest.approx(160 / 450)
    assert tally.to_json()["cached_share"] == pytest.approx(160 / 450)


def test_nothing_to_divide_by_is_none_never_an_infinity() -> None:
    empty = CacheTally.of([])
    assert empty.cached_share is None and empty.requests == 0
    assert ratio(1, 0) is None and ratio(None, 2) is None and ratio(3, None) is None
    assert ratio(3, 2) == 1.5
