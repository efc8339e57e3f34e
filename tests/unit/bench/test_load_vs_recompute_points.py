"""The throttle points of `hicache bench load-vs-recompute`: LATENCY_MS:BANDWIDTH, for L3
reads (--points) and for host->device loads (--host-points)."""

from __future__ import annotations

import argparse

import pytest

from hicache.bench.load_vs_recompute import (
    ThrottlePoint,
    load_throttle,
    parse_host_point,
    parse_point,
)
from hicache.testing.throttled_io import LoadThrottle


def test_a_point_is_a_latency_and_a_bandwidth_or_no_limit() -> None:
    assert parse_point("2:200MB") == ThrottlePoint(2.0, "200MB")
    assert parse_point("0.5:none") == ThrottlePoint(0.5, None)
    assert parse_point("3:unlimited").label == "unlimited"


@pytest.mark.parametrize("text", ["200MB", "fast:1GB"])
def test_a_malformed_point_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_point(text)


def test_a_host_point_becomes_the_throttle_of_the_host_to_device_loads() -> None:
    assert parse_host_point("2:200MB") == ThrottlePoint(2.0, "200MB")
    assert load_throttle(parse_host_point("2:200MB")) == LoadThrottle(0.002, 200e6)
    assert load_throttle(parse_host_point("0:none")) == LoadThrottle(0.0, None)


@pytest.mark.parametrize("text", ["2:fast", "2:0", "-1:none", "200MB"])
def test_a_host_point_with_a_bad_size_or_latency_is_refused_when_parsed(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_host_point(text)
