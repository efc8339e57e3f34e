"""One tier_aware decision on hand-built workers, for the scoring tests."""

from __future__ import annotations

import asyncio

from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.types import RouteDecision, RouteRequest, WorkerLoad


def route(index: PageIndex, config: ScoringConfig, pages: list[int],
          workers: list[WorkerLoad], page: int) -> RouteDecision:
    """tier_aware's choice for a prompt of ``pages`` whole pages of ``page`` tokens."""
    policy = build_policy("tier_aware", index, None, config)
    request = RouteRequest(page_hashes=pages, prompt_tokens=len(pages) * page,
                           workers=workers, page_size=page)
    return asyncio.run(policy.choose(request, list(range(len(pages) * page))))
