"""What the router's parts hand each other: one request's pages, the workers'
state as the router sees it, and the decision.

The HTTP side (worker registry, event subscribers, proxy) builds a
:class:`RouteRequest` and asks a :class:`RoutingPolicy`; the policy reads the
:class:`TierIndex` (fed by the subscribers) and the shared-pool lookup, and
answers with a :class:`RouteDecision` the proxy follows and the metrics record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache.engine.reuse_plan import CostSnapshot
from hicache.events.messages import KVEventBatch
from hicache.router.device_room import InFlight

# Tiers from the top; overlap in a tier is the longest prefix of the request's
# pages present in that tier or any tier above it on the same worker.
TIERS = ("GPU", "CPU_PINNED", "EXTERNAL")


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as the router last saw it."""

    url: str
    active_requests: int = 0  # proxied and not finished
    decode_blocks: float = 0.0  # pages being decoded there (Dynamo's decode_blocks term)
    # The router's ledger (``router.ledger``): predicted seconds of prefill it sent there
    # that have not produced a first token yet, and its requests past their first token.
    queued_prefill_s: float = 0.0
    decoding_requests: int = 0
    # The same ledger in pages: what the requests sent there compute before their first
    # token (tier_aware's ``pending_prefill`` load term).
    pending_prefill_pages: float = 0.0
    # The ledger's requests sent there still waiting for their first token.
    prefilling_requests: int = 0
    # Its device pool in pages (/get_server_info's max_total_num_tokens; None: not said),
    # and what the router sent there that has not ended (``ledger.in_flight``): the wait
    # for device room (``device_room.py``).
    device_pages: float | None = None
    in_flight: tuple[InFlight, ...] = ()
    # How full its cache is, 0..1 (its host pool, else its device pool), as last probed;
    # None: not known (tier_aware's derived overlap weight then takes it as full).
    cache_usage: float | None = None
    # The worker's live cost model as it last reported it (``router.live_costs``); None:
    # not measured (the predicted_ttft policy then prices it from the other workers').
    costs: CostSnapshot | None = None


@dataclass(frozen=True)
class TierOverlap:
    """Pages of the request's prefix one worker holds, per tier, counted from the
    first page: ``gpu`` <= ``host`` (device or host) <= ``external``."""

    gpu: int = 0
    host: int = 0
    external: int = 0


@dataclass(frozen=True)
class TierCosts:
    """Relative cost of bringing one page into a worker's device from each
    place, with recomputing it as 1.0 (``--tier-costs measured`` fills these
    from the worker's live cost model, else its totals: ``router.tier_costs``)."""

    host: float = 0.1
    external: float = 0.5


@dataclass(frozen=True)
class RouteRequest:
    page_hashes: Sequence[int]  # the request's full pages, chained (events.hashing)
    prompt_tokens: int  # whole prompt, including a partial last page
    workers: Sequence[WorkerLoad]  # healthy candidates, in registration order
    shared_cache_multiplier: float | None = None  # per-request override; None: the router's
    # Tokens per page, as the hashes were computed; the scoring policies need it.
    page_size: int | None = None
    # The request's tenant (its workers' extra_key), which its hashes chain from
    # (events.hashing.tenant_root_digest); None: the default tenant.
    tenant: str | None = None
    # The most tokens it may generate, as its body says (None: not said): what it holds
    # of a worker's device while it decodes.
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class RouteDecision:
    worker: str  # url of the chosen worker
    policy: str
    logits: Mapping[str, float] = field(default_factory=dict)  # lower wins; empty for round_robin
    overlaps: Mapping[str, TierOverlap] = field(default_factory=dict)
    shared_hits: int | None = None  # pages found in the shared pool; None: not asked or failed
    shared_beyond: int = 0  # shared pages past the chosen worker's device prefix
    # How the shared pool's query ended (policy.SharedQueryOutcome's values); None: not asked.
    shared_outcome: str | None = None
    # predicted_ttft and tier_aware: the chosen worker's predicted TTFT and its parts, in seconds
    # (``ttft_policy.TTFTTerms``'s fields), and where a cost was not that worker's own
    # measurement (``"<figure>=median"`` or ``"<figure>=default"``).
    predicted_ttft_s: float | None = None
    terms: Mapping[str, float] = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    # tier_aware and predicted_ttft: the worker the conversation's last turn went to, when
    # it is a candidate (router.affinity); None: a new conversation, or affinity off.
    home: str | None = None
    # tier_aware: the pages the chosen worker computes for this request (its prefill
    # term before the overlap weight); predicted_ttft: the pages its plan there computes.
    # The ledger's entry for it in pages.
    prefill_pages: float = 0.0
    # tier_aware: the overlap weight the chosen worker's prefill pages were scored with
    # (the flag's, or the one derived from its queue and cache: ``policy.py``).
    overlap_weight: float | None = None

    @property
    def predicted_prefill_s(self) -> float:
        """The chosen worker's own time for this request's prefill, the router's ledger
        entry for it (0 when the policy predicts nothing)."""
        return self.terms.get("own_s", 0.0)


class TierIndex(Protocol):
    """Which worker holds which page in which tier, built from KV events."""

    def apply(self, worker: str, batch: KVEventBatch) -> None: ...

    def clear_worker(self, worker: str) -> None:
        """Forget everything a worker announced (AllBlocksCleared, restart, resync)."""

    def remove_worker(self, worker: str) -> None: ...

    def overlaps(
        self, page_hashes: Sequence[int], workers: Sequence[str],
    ) -> dict[str, TierOverlap]: ...

    def num_pages(self) -> int: ...


class SharedPoolLookup(Protocol):
    """The shared L3's answer to "which of these pages do you hold?"."""

    async def hits(self, page_hashes: Sequence[int], token_ids: Sequence[int]) -> Sequence[bool]:
        """One flag per page; raises on failure (the policy then scores without it)."""


class RoutingPolicy(Protocol):
    name: str

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision: ...
