"""Scoring keeps tenants apart: a prompt hashed in its tenant's chain (as the workers'
events announce it) overlaps only that tenant's pages, and a tenant's request never
asks the shared pool, whose names are the default tenant's."""

from __future__ import annotations

import asyncio

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.events.messages import MEDIUM_GPU, BlockStored, KVEventBatch
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.prompt import PromptKind, body_cache_key, prompt_pages
from hicache.router.shared_pool import InMemorySharedPool
from hicache.router.types import RouteDecision, RouteRequest, TierOverlap, WorkerLoad

PAGE = 4
TOKENS = list(range(100, 116))


def tenant_pages(tenant: str | None) -> list[int]:
    return page_hashes(TOKENS, PAGE, tenant_root_digest(tenant))


def store(index: PageIndex, worker: str, hashes: list[int]) -> None:
    event = BlockStored(hashes, None, TOKENS, PAGE, None, MEDIUM_GPU)
    index.apply(worker, KVEventBatch(ts=0.0, events=[event]))


def choose(policy_name: str, index: PageIndex, tenant: str | None,
           shared: InMemorySharedPool | None = None) -> RouteDecision:
    request = RouteRequest(page_hashes=tenant_pages(tenant), prompt_tokens=len(TOKENS),
                           page_size=PAGE, tenant=tenant,
                           workers=[WorkerLoad("W0"), WorkerLoad("W1")])
    config = ScoringConfig(shared_cache_multiplier=1.0)
    policy = build_policy(policy_name, index, shared, config)
    return asyncio.run(policy.choose(request, TOKENS))


def test_a_tenants_pages_score_for_it_alone() -> None:
    index = PageIndex()
    store(index, "W1", tenant_pages("acme"))  # W1 holds acme's copy of the prompt
    for policy in ("cache_aware", "tier_aware"):
        acme = choose(policy, index, "acme")
        assert acme.worker == "W1"
        assert acme.overlaps["W1"] == TierOverlap(4, 4, 4)
        for other in ("globex", "acme/s", None):
            decision = choose(policy, index, other)
            assert all(o == TierOverlap(0, 0, 0) for o in decision.overlaps.values()), other


def test_a_tenants_request_does_not_ask_the_shared_pool() -> None:
    index = PageIndex()
    shared = InMemorySharedPool(tenant_pages(None))  # the default tenant's L3 names
    assert choose("tier_aware", index, None, shared).shared_hits == 4
    assert choose("tier_aware", index, "acme", shared).shared_hits is None


def test_the_router_hashes_a_body_in_its_tenants_chain() -> None:
    body = {"input_ids": TOKENS, "cache_salt": "s"}
    assert body_cache_key(body) == "s"  # as the worker's server.protocol.cache_key
    assert body_cache_key({"extra_key": ["e", "f"], "text": ["a", "b"]}) == "e"
    assert body_cache_key({"extra_key": 3}) is None  # the worker refuses it anyway
    ids, hashes = prompt_pages(PromptKind.GENERATE, body, None, PAGE, "acme")
    assert ids == TOKENS and hashes == tenant_pages("acme")
    assert prompt_pages(PromptKind.GENERATE, body, None, PAGE)[1] == tenant_pages(None)
