"""The cache hints' series on /metrics, read from ``engine.hint_status()`` at scrape time.

    hicache_hints_total{kind,outcome}   hints applied, by kind and outcome (counter)
    hicache_pinned_pages                host pages pinned now, every tenant
    hicache_pinned_pages_tenant{tenant} host pages pinned now, by tenant
    hicache_retained_pages              pages under a retain TTL now
    hicache_pin_budget_pages            host pages all pins together may hold

Invariant: the tenant label set is bounded. Tenants are whatever clients name, so
only the ``MAX_TENANT_SERIES`` holding the most pinned pages get a series of their
own and the rest are summed under ``tenant="other"``: a pin flood from many tenant
names cannot grow the scrape without bound. An engine without hints (a stand-in)
exports none of these.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

MAX_TENANT_SERIES: Final = 32
OTHER_TENANTS: Final = "other"


def tenant_series(by_tenant: Mapping[str, int]) -> list[tuple[str, int]]:
    """The tenants with the most pinned pages, each its own label (name order breaks
    ties, so the set is stable between scrapes), then the rest as "other"."""
    ranked = sorted(by_tenant.items(), key=lambda item: (-item[1], item[0]))
    top = ranked[:MAX_TENANT_SERIES]
    rest = ranked[MAX_TENANT_SERIES:]
    if rest:
        # A tenant really named "other" is folded into the rest: one series per label.
        kept = [(name, pages) for name, pages in top if name != OTHER_TENANTS]
        folded = sum(pages for name, pages in top if name == OTHER_TENANTS)
        return [*kept, (OTHER_TENANTS, folded + sum(pages for _, pages in rest))]
    return top


class HintCollector(Collector):
    """Reads ``engine.hint_status()`` at each scrape (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # nothing fixed to announce: an engine without hints has no series

    def collect(self) -> Iterator[Metric]:
        hint_status = getattr(self._engine, "hint_status", None)
        if hint_status is None:
            return
        status: dict[str, Any] = hint_status()
        outcomes = CounterMetricFamily(
            "hicache_hints", "hints applied, by kind and outcome", labels=["kind", "outcome"],
        )
        for key, count in sorted(status.get("outcomes", {}).items()):
            kind, _, outcome = str(key).partition("/")
            outcomes.add_metric([kind, outcome], float(count))
        yield outcomes
        yield GaugeMetricFamily(
            "hicache_pinned_pages", "host pages pinned now, every tenant",
            value=float(status.get("pinned_pages", 0)),
        )
        tenants = GaugeMetricFamily(
            "hicache_pinned_pages_tenant", f"host pages pinned now, by tenant (the "
            f"{MAX_TENANT_SERIES} with the most; the rest as tenant=\"{OTHER_TENANTS}\")",
            labels=["tenant"],
        )
        for tenant, pages in tenant_series(status.get("pinned_pages_by_tenant", {})):
            tenants.add_metric([tenant], float(pages))
        yield tenants
        yield GaugeMetricFamily(
            "hicache_retained_pages", "pages under a retain TTL now",
            value=float(status.get("retained_pages", 0)),
        )
        yield GaugeMetricFamily(
            "hicache_pin_budget_pages", "host pages all pins together may hold",
            value=float(status.get("pin_budget_pages", 0)),
        )
