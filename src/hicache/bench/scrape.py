"""A server's Prometheus /metrics, read once: samples by name and labels.

Benchmarks and cluster tests look at what each worker and the router count
(requests per worker, cached tokens by tier, pages written to L3) without
caring how the text format spells it. ``Samples.total(name, **labels)`` sums
every sample of ``name`` whose labels include the ones given.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed: counters with their "_total"
    labels: Mapping[str, str]
    value: float


class Samples:
    """Every sample of one scrape."""

    def __init__(self, samples: list[Sample]) -> None:
        self._samples = samples

    @classmethod
    def parse(cls, text: str) -> Samples:
        return cls([
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples
        ])

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._samples)

    def names(self) -> set[str]:
        return {s.name for s in self._samples}

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` carrying (at least) ``labels``; 0 when none."""
        return float(sum(
            s.value for s in self._samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed per value of ``label`` (e.g. requests per worker)."""
        out: dict[str, float] = {}
        for s in self._samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """GET ``url``/metrics and parse it (raises OSError when the server does not answer)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
        return Samples.parse(response.read().decode("utf-8", errors="replace"))
