"""``POST /hicache/hints`` at the router: each hint goes to the worker(s) its prefix is on.

The body is the workers' (``server/hints.py``): ``{"hints": [item, ...]}``. The router
checks every item as a worker would (``hint_protocol``) before sending anything, turns
texts into token ids with its tokenizer (the one its page hashes come from, so the
worker is told exactly the prefix the router placed) and then, per item:

- ``pin``, ``retain``, ``prefetch``: to the worker the routing policy would send a
  request with that prefix to: the one that holds it, or the one that will get it;
- ``unpin``, ``demote``: to every healthy worker the index says holds some of the
  prefix (device, host or a pin), or to every healthy worker when none is known to
  (a pin the router never heard of must still be found).

Each worker gets one ``/hicache/hints`` call with its items, all workers at once. The
answer is one outcome per item, in order, each with ``"worker"`` (the url that
answered it). An item sent to several workers gets their best outcome (accepted,
clipped, deferred, rejected, in that order), ``tokens`` summed over them, and the
per-worker outcomes under ``"workers"``. A worker that fails or refuses (unreachable,
draining, a 4xx) answers its items as rejected with its status and message: the
others' hints stand.

Invariants: a malformed body is a 400 naming ``hints[i]`` and no worker hears of it
(a negative id, or a prefix longer than the workers' context where they report it, is
malformed here too); with no healthy worker the answer is a 503 and nothing is sent. Ids
past the vocabulary are the workers' to judge (the router does not know its size): the
worker refuses its call with a 400, and its items come back rejected with that message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from starlette.concurrency import run_in_threadpool

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.router.credentials import redact
from hicache.router.types import RouteRequest, RoutingPolicy, TierIndex
from hicache.router.workers import Worker
from hicache.server.errors import APIError
from hicache.server.hint_protocol import HintItem
from hicache.server.hints import parse_items
from hicache.server.protocol import cache_key
from hicache.tenancy.identity import ANONYMOUS, Caller
from hicache.tokenizer.base import Tokenizer

HINTS_PATH: Final = "/hicache/hints"
# The kinds that follow the prefix to where it lives (or will); the others reach every
# holder.
_ROUTED_KINDS: Final = frozenset({"pin", "retain", "prefetch"})
_KINDS: Final = frozenset({"pin", "unpin", "retain", "prefetch", "demote"})
_RANK: Final = {"accepted": 0, "clipped": 1, "deferred": 2, "rejected": 3}
# Policy choices asked at once for one call (a policy may query the shared pool for each).
MAX_CONCURRENT_CHOICES: Final = 16
# Posts one worker's body (its url, the JSON content): (status, JSON answer or text).
Send = Callable[[str, bytes], Awaitable[tuple[int, Any]]]


@dataclass
class _Placed:
    """One item: its body as sent on, and the workers it goes to."""

    body: dict[str, Any]
    targets: list[str] = field(default_factory=list)


def parse_body(body: Mapping[str, Any]) -> list[HintItem]:
    """The body's items, checked as a worker checks them; APIError(400) naming the bad one."""
    unknown = sorted(set(body) - {"hints"})
    if unknown:
        raise APIError(400, f"unrecognized field {unknown[0]!r}: send {{\"hints\": [...]}}",
                       param=unknown[0])
    raw = body.get("hints")
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise APIError(400, "hints must be a list of objects", param="hints")
    return parse_items(raw)


def item_ids(item: HintItem, tokenizer: Tokenizer) -> list[int]:
    """The item's prefix as token ids (a text as the worker's engine tokenizes it)."""
    if item.input_ids is not None:
        return item.input_ids
    assert item.text is not None
    return tokenizer.encode(item.text)


def check_prefix(position: int, ids: Sequence[int], max_tokens: int | None) -> None:
    """APIError(400) naming ``hints[position]`` for a prefix no worker can hold."""
    where = f"hints[{position}]"
    if not ids:
        raise APIError(400, f"{where}: the text is no tokens", param=where)
    if max_tokens is not None and len(ids) > max_tokens:
        raise APIError(400, f"{where}: the prefix is {len(ids)} tokens, longer than the "
                       f"workers' context ({max_tokens})", param=where)
    negative = [t for t in ids if t < 0]
    if negative:
        raise APIError(400, f"{where}: negative token ids: {negative[:8]}", param=where)


def forwarded_item(item: HintItem, ids: list[int]) -> dict[str, Any]:
    """The item as a worker gets it: the same hint, the prefix as token ids."""
    body = item.model_dump(exclude_none=True, exclude={"text"})
    body["input_ids"] = ids
    return body


async def place(
    items: Sequence[HintItem], ids: Sequence[list[int]], workers: Sequence[Worker],
    policy: RoutingPolicy, index: TierIndex, page_size: int, caller: Caller = ANONYMOUS,
) -> list[_Placed]:
    """Where each item goes (see the module docstring). The policy's choices are asked
    side by side (up to ``MAX_CONCURRENT_CHOICES``): a policy may wait on the shared pool
    for each."""
    urls = [w.url for w in workers]
    loads = [w.load() for w in workers]
    # Each item's tenant, as the worker resolves it (server/hints.py, tenancy.identity).
    tenants = [caller.tenant(cache_key(None, item.cache_salt)) for item in items]

    def hash_and_find_holders() -> list[tuple[list[int], list[str]]]:
        # Off the event loop: a call may name a thousand context-long prefixes.
        out = []
        for item, tokens, tenant in zip(items, ids, tenants, strict=True):
            hashes = page_hashes(tokens, page_size, tenant_root_digest(tenant))
            holders: list[str] = []
            if item.kind not in _ROUTED_KINDS and hashes:
                overlaps = index.overlaps(hashes, urls)
                holders = [url for url in urls if url in overlaps and overlaps[url].host > 0]
            out.append((hashes, holders))
        return out

    found = await run_in_threadpool(hash_and_find_holders)
    limit = asyncio.Semaphore(MAX_CONCURRENT_CHOICES)

    async def choose(hashes: list[int], tokens: list[int], tenant: str | None) -> str:
        request = RouteRequest(page_hashes=hashes, prompt_tokens=len(tokens), workers=loads,
                               page_size=page_size, tenant=tenant)
        async with limit:
            return (await policy.choose(request, tokens)).worker

    placed = []
    routed: list[tuple[_Placed, Awaitable[str]]] = []
    for item, tokens, tenant, (hashes, holders) in zip(items, ids, tenants, found,
                                                       strict=True):
        entry = _Placed(forwarded_item(item, tokens))
        if item.kind in _ROUTED_KINDS:
            routed.append((entry, choose(hashes, tokens, tenant)))
        else:
            entry.targets = holders or list(urls)
        placed.append(entry)
    chosen = await asyncio.gather(*(choice for _, choice in routed))
    for (entry, _), url in zip(routed, chosen, strict=True):
        entry.targets = [url]
    return placed


def _refusal(status: int, answer: Any) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        answer = answer["error"].get("message", answer)
    return f"the worker answered {status}: {answer}"


def _worker_results(
    status: int, answer: Any, sent: Sequence[int], placed: Sequence[_Placed],
) -> dict[int, dict[str, Any]]:
    """Item index -> this worker's outcome for it (a rejection for each when it failed)."""
    results = answer.get("results") if status == 200 and isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != len(sent):
        reason = (_refusal(status, answer) if status != 200
                  else f"the worker's answer is not one outcome per hint: {answer!r:.200}")
        return {index: {"index": index, "kind": placed[index].body["kind"],
                        "outcome": "rejected", "tokens": 0, "clipped_tokens": 0,
                        "reason": reason} for index in sent}
    return {index: {**result, "index": index}
            for index, result in zip(sent, results, strict=True)}


def metric_labels(result: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, outcome) of a merged result as metric labels: a worker's answer is not
    trusted to keep the label set bounded, so anything unknown is "other"."""
    kind, outcome = str(result.get("kind")), str(result.get("outcome"))
    return (kind if kind in _KINDS else "other", outcome if outcome in _RANK else "other")


def merge(index: int, per_worker: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """One item's outcome from the workers it went to (see the module docstring)."""
    answered = [{**outcome, "worker": redact(url)} for url, outcome in per_worker.items()]
    if len(answered) == 1:
        return answered[0]
    best = min(answered, key=lambda o: _RANK.get(str(o.get("outcome")), len(_RANK)))
    return {**best, "index": index, "tokens": sum(int(o.get("tokens", 0)) for o in answered),
            "workers": answered}


async def forward_hints(
    body: Mapping[str, Any], workers: Sequence[Worker], policy: RoutingPolicy,
    index: TierIndex, page_size: int, tokenizer: Tokenizer, send: Send,
    max_prefix_tokens: int | None = None, caller: Caller = ANONYMOUS,
) -> dict[str, Any]:
    """Check, place and send the body's hints; the merged outcomes (``{"results"}``).
    ``send(url, content)`` posts one worker's body and answers (status, JSON or text);
    ``max_prefix_tokens``: the workers' context, when known; ``caller``: whose hints they
    are (each prefix hashes in its tenant's chain, as the worker keys it)."""
    items = parse_body(body)
    if not workers:
        raise APIError(503, "no healthy worker to send the hints to")
    ids = [await run_in_threadpool(item_ids, item, tokenizer) if item.text is not None
           else item_ids(item, tokenizer) for item in items]
    for position, tokens in enumerate(ids):
        check_prefix(position, tokens, max_prefix_tokens)
    placed = await place(items, ids, workers, policy, index, page_size, caller)
    by_worker: dict[str, list[int]] = {}
    for position, entry in enumerate(placed):
        for url in entry.targets:
            by_worker.setdefault(url, []).append(position)

    async def one(url: str, sent: list[int]) -> tuple[str, dict[int, dict[str, Any]]]:
        content = json.dumps({"hints": [placed[i].body for i in sent]}).encode()
        status, answer = await send(url, content)
        return url, _worker_results(status, answer, sent, placed)

    answers = await asyncio.gather(*(one(url, sent) for url, sent in by_worker.items()))
    outcomes: dict[int, dict[str, dict[str, Any]]] = {}
    for url, results in answers:
        for position, result in results.items():
            outcomes.setdefault(position, {})[url] = result
    return {"results": [merge(position, outcomes[position]) for position in range(len(items))]}
