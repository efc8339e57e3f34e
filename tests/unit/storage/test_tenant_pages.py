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
