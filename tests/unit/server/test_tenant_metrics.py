"""hicache_tenant_bytes{tier,tenant}: parsed from the engine's keys, per tier the 16 largest
tenants plus "other" (a bounded label set), ties broken by name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from hicache.server.tenant_metrics import (
    MAX_TENANT_SERIES,
    tenant_bytes_family,
    tenant_key,
    top_tenants,
)


def samples(values: dict[str, float]) -> dict[tuple[str, str], float]:
    family = tenant_bytes_family(values)
    return {(s.labels["tier"], s.labels["tenant"]): s.value for s in family.samples}


def test_each_tier_and_tenant_is_a_series() -> None:
    values = {
        tenant_key("device", "default"): 100.0, tenant_key("device", "a_b:c@d"): 50.0,
        tenant_key("host", "a_b:c@d"): 70.0, tenant_key("l3", "x"): 9.0,
        "cache_num_requests": 3.0,  # not a tenant key
    }
    assert samples(values) == {
        ("device", "default"): 100.0, ("device", "a_b:c@d"): 50.0,
        ("host", "a_b:c@d"): 70.0, ("l3", "x"): 9.0,
    }


def test_many_tenants_are_the_top_ones_plus_other() -> None:
    values = {tenant_key("host", f"t{i:03d}"): float(i) for i in range(100)}
    got = samples(values)
    assert len(got) == MAX_TENANT_SERIES + 1
    top = {f"t{i:03d}" for i in range(100 - MAX_TENANT_SERIES, 100)}
    assert {tenant for _, tenant in got} == top | {"other"}
    assert got[("host", "other")] == sum(range(100 - MAX_TENANT_SERIES))
    assert sum(got.values()) == sum(range(100))


def test_ties_are_broken_by_name_and_a_tenant_named_other_is_folded() -> None:
    by_tenant = {name: 1.0 for name in ("b", "a", "c")}
    assert top_tenants(by_tenant, limit=2) == [("a", 1.0), ("b", 1.0), ("other", 1.0)]
    named_other = {"other": 5.0, "a": 4.0, "b": 1.0}
    assert top_tenants(named_other, limit=2) == [("a", 4.0), ("other", 6.0)]


def test_the_family_renders_as_prometheus_text() -> None:
    family = tenant_bytes_family({tenant_key("device", "t1"): 2048.0})

    class One(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            yield family

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    assert 'hicache_tenant_bytes{tenant="t1",tier="device"} 2048.0' in text
