"""TenantPages: one owner per name, bytes per tenant, least recently used order per tenant."""

from __future__ import annotations

from hicache.storage.tenant_pages import TenantPages


def test_orders_bytes_and_moves() -> None:
    pages = TenantPages()
    pages.add("a1", "a", 10)
    pages.add("b1", "b", 5)
    pages.add("a2", "a", 10)
    pages.add("d1", None, 7)
    assert pages.usage() == {"a": 20, "b": 5, None: 7}
    pages.touch("a1")
    assert [name for name, _ in pages.oldest("a")] == ["a2", "a1"]
    pages.demote("a1")
    assert pages.least_recent("a", 1) == ["a1"] and pages.least_recent("x", 3) == []
    assert pages.names("a") == ["a1", "a2"]
    pages.add("a1", "b", 3)  # re-recorded: one owner at a time
    assert pages.usage() == {"a": 10, "b": 8, None: 7}
    assert pages.tenant_of("a1") == "b"
    assert pages.remove("a2") == ("a", 10)
    assert pages.remove("a2") is None
    assert "a" not in pages.usage() and len(pages) == 3
    pages.clear()
    assert pages.usage() == {} and "b1" not in pages


def test_evict_for_forgets_the_tenants_oldest_until_the_batch_fits() -> None:
    pages = TenantPages()
    for name in ("a1", "a2", "a3"):
        pages.add(name, "acme", 10)
    pages.add("g1", "globex", 10)
    # 30 of acme's 40 bytes used; 2 new objects of 10: one old object must go, never a1
    # (in the batch) nor globex's.
    victims, fits = pages.evict_for("acme", 2, 10, 40, keep={"a1"})
    assert (victims, fits) == (["a2"], 2)
    assert pages.bytes_of("acme") == 20 and pages.bytes_of("globex") == 10
    # Nothing of its own may go: what fits is what is left of the quota.
    victims, fits = pages.evict_for("acme", 5, 10, 40, keep={"a1", "a3"})
    assert (victims, fits) == ([], 2)


def test_expired_forgets_a_tenants_writes_past_the_ttl_oldest_first() -> None:
    pages = TenantPages()
    pages.add("a1", "a", 10, written_s=100.0)
    pages.add("b1", "b", 10, written_s=100.0)
    pages.add("a2", "a", 10, written_s=150.0)
    pages.add("a3", "a", 10)  # no write time: never expires by TTL
    pages.touch("a1")  # a read does not make a write younger
    assert not pages.is_expired("a1", 60.0, 160.0) and pages.is_expired("a1", 60.0, 161.0)
    assert not pages.is_expired("a3", 60.0, 1e9) and not pages.is_expired("zz", 60.0, 1e9)
    assert pages.expired("a", 60.0, 161.0) == ["a1"]
    assert pages.bytes_of("a") == 20 and pages.bytes_of("b") == 10  # b's own TTL is b's
    pages.add("a2", "a", 10, written_s=200.0)  # written again: its age starts again
    assert pages.expired("a", 60.0, 230.0) == []
    assert pages.expired("a", 60.0, 261.0) == ["a2"]
    assert pages.names("a") == ["a3"]
    pages.remove("b1")
    assert pages.expired("b", 1.0, 1e9) == []
