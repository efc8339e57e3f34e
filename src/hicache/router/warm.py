"""Warm-on-join: a worker that joins the router gets the most recent prompts prefetched
from L3 into its host tier before it takes traffic.

A worker joins when it is added through the admin API (``POST /workers``) or when a
known worker answers again after being down or draining (a restart at the same URL);
the workers given at start-up do not join (nothing was routed yet). A joining worker
is *warming* (``workers.py``): in the registry and probed, but routed to only when no
other worker is routable. The warmer posts ``/hicache/warm`` to it (with the router's
admin key, which the workers share) naming the most recent prompts of the request
history (``history.py``) that fit the worker's host pool times its warm fraction
(both from its /get_server_info), waits at most ``--warm-on-join-timeout-s`` (0 turns
warming off), and the worker becomes routable whatever the outcome: a warm that
fails, times out, or finds nothing to do is logged and counted, never fatal.

Outcomes (``router_warms_total{outcome}``): ``warmed`` (the worker answered 200; its
tokens are added to ``router_warm_tokens_total``), ``timeout``, ``failed`` (an error
answer or a broken connection), ``skipped`` (no L3 on the worker, no host pool size,
or nothing recorded yet).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from hicache.router.credentials import redact
from hicache.router.history import DEFAULT_MAX_ENTRIES, RequestHistory

logger = logging.getLogger(__name__)

WARM_ROUTE = "/hicache/warm"
DEFAULT_WARM_ON_JOIN_TIMEOUT_S = 20.0
# The worker's own default (--warm-host-fraction) when its /get_server_info does not say.
DEFAULT_HOST_FRACTION = 0.5
# The worker is asked to answer this long before the router stops waiting, so that what
# it warmed is reported rather than lost to a timeout.
ANSWER_MARGIN = 0.9
OUTCOMES = ("warmed", "timeout", "failed", "skipped")


@dataclass(frozen=True)
class WarmOutcome:
    outcome: str  # one of OUTCOMES
    tokens: int = 0  # prompt tokens the worker reports warmed
    detail: str = ""


def host_budget_tokens(info: Mapping[str, Any]) -> int | None:
    """Tokens a warm may bring into the worker's host tier: its host pool (pages x page
    size) x its warm fraction; None when it does not report its host pool."""
    page_size = info.get("page_size")
    memory = info.get("memory")
    pages = memory.get("host_pool_pages") if isinstance(memory, Mapping) else None
    if pages is None:
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], Mapping):
            pages = states[0].get("host_pool_pages")
    num_pages, tokens_per_page = _positive(pages), _positive(page_size)
    if num_pages is None or tokens_per_page is None:
        return None
    fraction = _positive(info.get("hicache_warm_host_fraction"))
    if fraction is None or fraction > 1:
        fraction = DEFAULT_HOST_FRACTION
    return int(int(num_pages) * int(tokens_per_page) * fraction)


def _positive(value: Any) -> float | None:
    """``value`` when it is a positive number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def has_l3(info: Mapping[str, Any]) -> bool:
    l3 = info.get("l3")
    if isinstance(l3, Mapping):
        return bool(l3.get("attached"))
    return info.get("hicache_storage_backend") is not None


class JoinWarmer:
    """Warms joining workers from the request history (module docstring)."""

    def __init__(
        self, history: RequestHistory, client: httpx.AsyncClient, timeout_s: float,
        admin_api_key: str | None = None,
    ) -> None:
        self.history = history
        self.timeout_s = timeout_s
        self._client = client
        self._headers = {"authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.tokens = 0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def items_for(self, info: Mapping[str, Any]) -> list[list[int]] | None:
        """The prompts to warm ``info``'s worker with, or None when it cannot be warmed."""
        budget = host_budget_tokens(info)
        if budget is None or not has_l3(info):
            return None
        context = _positive(info.get("context_length"))
        page_size = int(info["page_size"])
        return self.history.recent(
            budget, page_size, DEFAULT_MAX_ENTRIES,
            max_tokens_each=None if context is None else int(context),
        )

    async def warm(self, url: str, info: Mapping[str, Any]) -> WarmOutcome:
        """Warm the worker at ``url`` (described by its /get_server_info ``info``); the
        outcome is counted and logged, never raised."""
        outcome = await self._warm(url, info)
        self.outcomes[outcome.outcome] += 1
        self.tokens += outcome.tokens
        log = logger.info if outcome.outcome in ("warmed", "skipped") else logger.warning
        log("worker %s warm-on-join %s%s", redact(url), outcome.outcome,
            f": {outcome.detail}" if outcome.detail else "")
        return outcome

    async def _warm(self, url: str, info: Mapping[str, Any]) -> WarmOutcome:
        items = self.items_for(info)
        if items is None:
            return WarmOutcome("skipped", detail="the worker reports no L3 or no host pool")
        if not items:
            return WarmOutcome("skipped", detail="no prompt recorded yet")
        body = {"input_ids": items, "timeout_s": max(0.1, self.timeout_s * ANSWER_MARGIN)}
        try:
            response = await self._client.post(f"{url}{WARM_ROUTE}", json=body,
                                               headers=self._headers, timeout=self.timeout_s)
        except httpx.TimeoutException:
            return WarmOutcome("timeout", detail=f"no answer in {self.timeout_s:g} s")
        except httpx.HTTPError as error:
            return WarmOutcome("failed", detail=redact(f"{type(error).__name__}: {error}"))
        if response.status_code != 200:
            return WarmOutcome("failed", detail=f"{WARM_ROUTE} answered "
                               f"{response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
            tokens = int(answer.get("tokens", 0))
        except (ValueError, TypeError, AttributeError):
            return WarmOutcome("failed", detail=f"{WARM_ROUTE} answered no JSON object")
        return WarmOutcome("warmed", tokens=max(0, tokens),
                           detail=f"{tokens} tokens of {len(items)} recent prompts")
