"""A run's TTFT split by where the time went: outside the worker, queued there, held for
L3 pages or device room, computed."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.bench.report import RequestRecord
from hicache.bench.ttft_split import split_table, ttft_split


def record(ttft: float | None, server: float | None, reuse: dict[str, Any] | None = None,
           ok: bool = True) -> RequestRecord:
    return RequestRecord(session=0, round=0, group=0, sent_s=0.0, ok=ok, latency_s=2.0,
                         ttft_s=ttft, ttft_from_content=True, itl_s=[], prompt_tokens=256,
                         output_tokens=8, cached_tokens=0, cached_by_tier=None,
                         server_ttft_s=server, reuse=reuse)


def test_the_split_adds_up_to_the_workers_ttft() -> None:
    records = [
        record(1.0, 0.9, {"decision": "load", "waited_s": 0.3, "actual_s": 0.4}),
        record(2.0, 1.8, {"decision": "load", "waited_s": None, "actual_s": 0.6}),  # not held
        record(0.5, 0.45),  # a device hit or a cold prompt: no report
        record(0.7, None),  # a server that does not say
        record(None, None, ok=False),
    ]
    s = ttft_split(records)
    assert s.requests == 4 and s.reported == 2
    assert s.ttft_s == pytest.approx((1.0 + 2.0 + 0.5 + 0.7) / 4)
    assert s.server_ttft_s == pytest.approx((0.9 + 1.8 + 0.45) / 3)
    assert s.outside_s == pytest.approx((0.1 + 0.2 + 0.05) / 3)
    assert s.held_s == pytest.approx(0.15)
    assert s.computed_s == pytest.approx(0.5)
    assert s.queued_s == pytest.approx((0.2 + 1.2) / 2)
    table = split_table([("tier_aware", s)])
    assert "tier_aware" in table and "queued ms" in table


def test_nothing_reported_leaves_the_parts_unknown() -> None:
    s = ttft_split([record(0.5, None)])
    assert s.requests == 1 and s.reported == 0
    assert s.server_ttft_s is None and s.outside_s is None
    assert s.queued_s is None and s.held_s is None and s.computed_s is None
    assert ttft_split([]).ttft_s is None
