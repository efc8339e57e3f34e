"""The router's reader of /metrics text takes the samples prometheus_client's parser takes
(names, labels unescaped, values), and stops at a malformed line keeping what came before."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache.router.metrics_text import MetricsTextError, samples
from hicache.router.tier_costs import prometheus_samples


def exposition() -> str:
    """A registry's text as a worker serves it: counters, gauges, a histogram, labels with
    quotes, backslashes, newlines and braces in their values, NaN and infinities."""
    registry = CollectorRegistry()
    Counter("hicache_requests", "requests", registry=registry).inc(3)
    gauge = Gauge("hicache_cost_l3", "cost", ["backend"], registry=registry)
    gauge.labels("file").set(0.25)
    gauge.labels('we"ird\\one\n{x}').set(1.5)
    Gauge("hicache_nan", "not measured", registry=registry).set(math.nan)
    Gauge("hicache_inf", "infinite", registry=registry).set(-math.inf)
    pair = Gauge("hicache_pair", "two labels", ["a", "b"], registry=registry)
    pair.labels("1", "2").set(7)
    histogram = Histogram("hicache_ttft_seconds", "ttft", registry=registry,
                          buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 3.0):
        histogram.observe(value)
    return generate_latest(registry).decode()


def reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text) for sample in family.samples
    ]


def same(a: list[tuple[str, dict[str, str], float]],
         b: list[tuple[str, dict[str, str], float]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True)
    )


def test_the_samples_are_prometheus_clients() -> None:
    text = exposition()
    got = list(samples(text))
    assert same(got, reference(text))
    names = {name for name, _, _ in got}
    assert {"hicache_requests_total", "hicache_ttft_seconds_bucket", "hicache_nan"} <= names
    assert ("hicache_cost_l3", {"backend": 'we"ird\\one\n{x}'}, 1.5) in got


def test_timestamps_blank_lines_and_a_trailing_comma() -> None:
    text = 'a 1 1700000000000\n\n  # HELP b x\nb{l="v",} 2\nc{} +Inf\n'
    assert list(samples(text)) == [("a", {}, 1.0), ("b", {"l": "v"}, 2.0),
                                   ("c", {}, math.inf)]
    assert same(list(samples(text)), reference(text))


@pytest.mark.parametrize("bad", ["b{l=v} 2", "b two", "b{l=\"v\" 2", "{l=\"v\"} 2"])
def test_a_malformed_line_ends_the_reading_keeping_what_came_before(bad: str) -> None:
    text = f"a 1\n{bad}\nc 3\n"
    with pytest.raises(MetricsTextError):
        list(samples(text))
    assert prometheus_samples(text) == {"a": 1.0}
