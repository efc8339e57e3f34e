"""``hicache_tenant_bytes{tier,tenant}``: the bytes each tenant's cached KV takes, per tier.

The engine reports every tenant holding pages (``Engine.metrics``: keys
``tenant_bytes_<tier>_<tenant label>``, tier ``device``, ``host`` or ``l3``; the default
tenant is labelled ``default``). Invariant: the label set is bounded. Tenants are whatever
clients name, so per tier only the ``MAX_TENANT_SERIES`` holding the most bytes get a
series of their own and the rest are summed under ``tenant="other"``: many tenant names
cannot grow the scrape without bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from prometheus_client.core import GaugeMetricFamily

MAX_TENANT_SERIES: Final = 16
OTHER_TENANTS: Final = "other"
KEY_PREFIX: Final = "tenant_bytes_"
TIERS: Final = ("device", "host", "l3")
NAME: Final = "hicache_tenant_bytes"


def top_tenants(by_tenant: Mapping[str, float], limit: int = MAX_TENANT_SERIES
                ) -> list[tuple[str, float]]:
    """The ``limit`` tenants with the most bytes, each its own label (name order breaks
    ties, so the set is stable between scrapes), then the rest summed as "other" (a tenant
    really named "other" is counted there too: one series per label)."""
    ranked = sorted(by_tenant.items(), key=lambda item: (-item[1], item[0]))
    if len(ranked) <= limit:
        return ranked
    top = [(name, value) for name, value in ranked[:limit] if name != OTHER_TENANTS]
    rest = sum(value for name, value in ranked if (name, value) not in top)
    return [*top, (OTHER_TENANTS, rest)]


def tenant_key(tier: str, label: str) -> str:
    """The engine metrics key of a tenant's bytes in ``tier``."""
    return f"{KEY_PREFIX}{tier}_{label}"


def tenant_bytes_family(values: Mapping[str, float]) -> GaugeMetricFamily:
    """The family from the engine's ``tenant_bytes_*`` keys (other keys are ignored)."""
    by_tier: dict[str, dict[str, float]] = {tier: {} for tier in TIERS}
    for key, value in values.items():
        if not key.startswith(KEY_PREFIX):
            continue
        tier, _, label = key.removeprefix(KEY_PREFIX).partition("_")
        if tier in by_tier and label:
            by_tier[tier][label] = value
    family = GaugeMetricFamily(
        NAME, f"bytes of cached KV per tenant and tier (per tier the {MAX_TENANT_SERIES} "
        f"tenants with the most; the rest as tenant=\"{OTHER_TENANTS}\")",
        labels=["tier", "tenant"],
    )
    for tier in TIERS:
        for tenant, value in top_tenants(by_tier[tier]):
            family.add_metric([tier, tenant], value)
    return family
