"""KV event hashes per tenant: the default tenant's are SGLang's, unchanged; every other
tenant's chain from its own root digest, so two tenants' identical pages never share one."""

from __future__ import annotations

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import WritePolicy
from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.events.messages import MEDIUM_GPU, BlockStored
from tests.unit.events.test_emitter import make_cache

PAGE = 4


def store(cache: HierarchicalCache, tokens: list[int], extra_key: str | None) -> None:
    """One request's prefill inserted under ``extra_key`` (no KV check: hashes only)."""
    fresh = cache.alloc_device(len(tokens) // PAGE)
    cache.insert(tokens, fresh, extra_key)
    cache.poll()


def stored_hashes(events: list[object]) -> list[list[int]]:
    return [e.block_hashes for e in events  # type: ignore[attr-defined]
            if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]


def test_default_hashes_are_unchanged_and_tenants_differ() -> None:
    tokens = list(range(3 * PAGE))
    cache, sink = make_cache(WritePolicy.WRITE_THROUGH, page_size=PAGE, device_pages=16)
    try:
        store(cache, tokens, None)
        store(cache, tokens, "acme")
        store(cache, tokens, "globex")
        store(cache, tokens, "acme/\x00s1")  # a salt nested under acme
        cache.publish_events()
        default, acme, globex, nested = stored_hashes(sink.events())
        # The default tenant: exactly the scheme's hashes, as before tenancy (and SGLang).
        assert default == page_hashes(tokens, PAGE)
        assert default == page_hashes(tokens, PAGE, tenant_root_digest(None))
        # Each tenant: the scheme chained from its root digest, which a router computes.
        assert acme == page_hashes(tokens, PAGE, tenant_root_digest("acme"))
        assert globex == page_hashes(tokens, PAGE, tenant_root_digest("globex"))
        assert nested == page_hashes(tokens, PAGE, tenant_root_digest("acme/\x00s1"))
        every = [set(h) for h in (default, acme, globex, nested)]
        for i, one in enumerate(every):
            for other in every[i + 1:]:
                assert not one & other
    finally:
        cache.close()


def test_a_tenants_child_chains_from_its_parent_under_the_tenant() -> None:
    cache, sink = make_cache(WritePolicy.WRITE_THROUGH, page_size=PAGE, device_pages=16)
    try:
        head, tail = list(range(2 * PAGE)), [99] * PAGE
        store(cache, head, "acme")
        store(cache, head + tail, "acme")  # a child of acme's node
        cache.publish_events()
        child = next(e for e in sink.events() if isinstance(e, BlockStored)
                     and e.medium == MEDIUM_GPU and e.token_ids == tail)
        want = page_hashes(head + tail, PAGE, tenant_root_digest("acme"))
        assert child.block_hashes == want[-1:]
        assert child.parent_block_hash == want[-2]
    finally:
        cache.close()


def test_the_root_digest_is_per_tenant_and_none_for_the_default() -> None:
    assert tenant_root_digest(None) is None
    roots = {tenant_root_digest(t) for t in ("a", "b", "a/b", "", "\udc80")}
    assert len(roots) == 5
