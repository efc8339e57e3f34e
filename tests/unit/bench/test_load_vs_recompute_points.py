"""The throttle points of `hicache bench load-vs-recompute`: LATENCY_MS:BANDWIDTH."""

from __future__ import annotations

import argparse

import pytest

from hicache.bench.load_vs_recompute import ThrottlePoint, parse_point


def test_a_point_is_a_latency_and_a_bandwidth_or_no_limit() -> None:
    assert parse_point("2:200MB") == ThrottlePoint(2.0, "200MB")
    assert parse_point("0.5:none") == ThrottlePoint(0.5, None)
    assert parse_point("3:unlimited").label == "unlimited"


@pytest.mark.parametrize("text", ["200MB", "fast:1GB"])
def test_a_malformed_point_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_point(text)
