"""Routing policies: which worker a request goes to, and why.

Five policies (``--policy``), each a small strategy object behind
:func:`build_policy`:

- ``round_robin``: the next worker in turn.
- ``least_load``: fewest active requests, then fewest decode blocks.
- ``cache_aware``: Dynamo's default KV routing, device overlap only::

      logit = overlap_weight * (prompt_tokens - gpu_overlap * page) / page + decode_blocks

- ``tier_aware``: Dynamo's shared-cache KV routing, over every tier::

      prefill_tokens   = prompt_tokens - device_credit * gpu_overlap * page
      adjusted_prefill = max(0, prefill_tokens - shared_cache_multiplier * hits_beyond(n) * page)
      logit            = overlap_weight * adjusted_prefill / page + load

  where ``hits_beyond(n)`` counts the shared pool's pages at positions >= n.
  Beyond Dynamo, the worker's host tier counts too: each page on its host past
  its device prefix reduces the prefill by ``host_multiplier`` pages, and the
  shared pages are then counted past the host prefix (n = host overlap, which
  is the device overlap when the host adds nothing: Dynamo's formula). With
  ``tier_costs="measured"`` a page from the host saves ``1 - TierCosts.host``
  of a page's prefill and one from the shared pool ``1 - TierCosts.external``,
  from what that worker measured (``router.tier_costs``). The ``load`` term is
  Dynamo's ``decode_blocks`` (``load_term="prompt_pages"``, ``ScoringConfig``'s default):
  every prompt page of the requests in flight there, computed or cached, prefilling or
  decoding; or (``"pending_prefill"``, ``hicache router``'s default) the pages the
  requests sent there still compute before their first token, each the
  ``adjusted_prefill`` it was routed with (the router's ledger): at ``overlap_weight`` 1
  the logit is the pages of prefill the worker computes before
  this request's first token; above 1 a page this request would recompute also counts
  for the requests that will queue behind it.

  The overlap weight may be derived per worker (``overlap_weight`` None, ``--overlap-weight
  auto``) rather than given: ``1 + prefilling + usage``. A page of prefill a request adds to
  a worker delays its own first token (the 1), and every request that reaches that worker
  before it is done: as many, by Little's law, as are waiting there now for their first
  token (``prefilling``, the router's ledger); and once the worker's cache is full, each
  page it computes pushes out a cached page that may be asked for again (``usage``: its
  host pool's share in use, else its device pool's, from its /metrics; taken as full
  until probed). Nothing in it is tuned: an idle cluster with room in its caches weighs a
  page of prefill as one, a busy one with full caches as several.
  Every tier_aware decision also reports the chosen worker's predicted TTFT from its live
  cost model (``ttft_model.py``, as predicted_ttft prices it), beside the measured one.

- ``predicted_ttft`` (``ttft_policy.py``): each worker's predicted time to first token,
  in seconds, from its live cost model and the router's ledger of its queue; with
  ``ttft_score="cluster"`` plus the delay its forward there causes the others.

With ``conversation_affinity`` (``--conversation-affinity on``; off by default)
``tier_aware`` and ``predicted_ttft`` send a turn to its conversation's home, the worker
its last turn went to (``affinity.py``), when the home holds no less of the prefix than
the best worker and costs the turn at most its own size more: for ``tier_aware`` a load
term higher by at most the turn's prompt pages, for ``predicted_ttft`` a predicted TTFT
longer by at most the turn's own prefill.

Lower logits win; ties go to fewer active requests, then to the worker this policy
chose least recently, then registration order. The middle step matters for new
conversations on an idle or evenly loaded cluster: every worker scores the same, and
registration order alone sent them all to the first worker, where their later turns,
drawn back by the cache they left there, then queued behind each other while another
worker idled (the router sweep's Poisson points, 2026-11-29: 14, 12 and 3 requests).

On ``device_credit``: the worked example that came with that scoring (4 pages,
multiplier 0.5, page 1, the shared pool holding pages 0-3; W0 with 2 device pages
scores 3.0, W1 with none 2.0 and wins) only comes out with ``device_credit = 0``: the example does
not subtract the device overlap from the prefill. Dynamo's scheduler does
(``prefill_tokens`` is what the worker still has to compute), and a worker
never recomputes pages it holds on its device, so our default is 1.0. The
unit tests check both: the example's logits exactly with ``device_credit=0``,
and the default's choice (W0) on the same request.

``tier_aware`` asks the shared pool (``SharedPoolLookup``) which pages it holds
while it walks the index (started before the walk, synchronously when the pool
can ``submit``), under ``shared_deadline_s``. On failure or timeout it
scores from the index alone (the EXTERNAL pages the workers announced), logs a
warning (at most one per ``WARNING_INTERVAL_S``), reports ``shared_hits=None``,
and still routes the request. Each decision reports how its query ended
(``SharedQueryOutcome``: answered, late, failed) for the router's /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from hicache.router.affinity import ConversationHomes
from hicache.router.ttft_model import predict_for
from hicache.router.types import (
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    SharedPoolLookup,
    TierCosts,
    TierIndex,
    TierOverlap,
    WorkerLoad,
)

logger = logging.getLogger(__name__)

# At most one "shared pool query failed" warning per this many seconds.
WARNING_INTERVAL_S: Final = 10.0
# Logits closer than this are a tie (float noise must not decide).
_TIE_DIGITS: Final = 9
# cache_aware's overlap weight when none is given (Dynamo's default).
DYNAMO_OVERLAP_WEIGHT: Final = 1.0


class PolicyName(str, Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"
    TIER_AWARE = "tier_aware"
    PREDICTED_TTFT = "predicted_ttft"  # router.ttft_policy


# The policies that price with the workers' live cost models: the registry probes them.
LIVE_COST_POLICIES: Final = frozenset({"tier_aware", "predicted_ttft"})


class TierCostMode(str, Enum):
    FIXED = "fixed"  # host_multiplier and shared_cache_multiplier for every worker
    MEASURED = "measured"  # each worker's TierCosts


class LoadTerm(str, Enum):
    """tier_aware's load term (``ScoringConfig.load_term``)."""

    PROMPT_PAGES = "prompt_pages"  # Dynamo's decode_blocks: in-flight requests' prompt pages
    PENDING_PREFILL = "pending_prefill"  # pages still to compute before their first tokens


class TTFTScore(str, Enum):
    """What predicted_ttft minimises (``ScoringConfig.ttft_score``)."""

    OWN = "own"  # the request's own predicted TTFT
    # Its predicted TTFT plus what its forward there delays the others (``ttft_policy.py``).
    CLUSTER = "cluster"


class SharedQueryOutcome(str, Enum):
    """How a decision's shared-pool query ended (``RouteDecision.shared_outcome``)."""

    ANSWERED = "answered"  # within the deadline: the decision used it
    LATE = "late"  # past the deadline: scored from the index alone
    FAILED = "failed"  # the pool raised (unreachable, busy) or answered nonsense


class NoWorkerError(LookupError):
    """No healthy worker to route to (the proxy answers 503)."""


@dataclass(frozen=True)
class ScoringConfig:
    # None: tier_aware derives each worker's weight from its queue and cache
    # (``derived_weight``); cache_aware then scores with Dynamo's 1.0.
    overlap_weight: float | None = 1.0
    # Prefill pages one shared-pool page saves (Dynamo's default 0.0: asked, then ignored).
    shared_cache_multiplier: float = 0.0
    # Prefill pages one device page saves (see the module docstring: 1.0, or 0 for the
    # worked example's).
    device_credit: float = 1.0
    # Prefill pages one host page past the device prefix saves (tier_costs "fixed").
    host_multiplier: float = 0.9
    tier_costs: str = TierCostMode.FIXED.value
    shared_deadline_s: float = 0.02
    # tier_aware and predicted_ttft: send a conversation's turn to the worker its last
    # turn went to (``affinity.py``) while that costs the turn no more than its own size.
    # Off by default: measured no better at ws 2 and worse at ws 4 (docs/benchmarks.md).
    conversation_affinity: bool = False
    # tier_aware's load term (``LoadTerm``).
    load_term: str = LoadTerm.PROMPT_PAGES.value
    # predicted_ttft's score (``TTFTScore``).
    ttft_score: str = TTFTScore.OWN.value

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "shared_cache_multiplier", "device_credit",
                     "host_multiplier"):
            value = getattr(self, name)
            if name == "overlap_weight" and value is None:
                continue  # derived per worker
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be a number >= 0, got {value}")
        if not self.shared_deadline_s > 0:
            raise ValueError(f"shared_deadline_s must be > 0, got {self.shared_deadline_s}")
        modes = [mode.value for mode in TierCostMode]
        if self.tier_costs not in modes:
            raise ValueError(f"tier_costs must be one of {', '.join(modes)}, got "
                             f"{self.tier_costs!r}")
        terms = [term.value for term in LoadTerm]
        if self.load_term not in terms:
            raise ValueError(f"load_term must be one of {', '.join(terms)}, got "
                             f"{self.load_term!r}")
        scores = [score.value for score in TTFTScore]
        if self.ttft_score not in scores:
            raise ValueError(f"ttft_score must be one of {', '.join(scores)}, got "
                             f"{self.ttft_score!r}")


def hits_beyond(hits: Sequence[bool], start: int) -> int:
    """Shared-pool pages at positions >= ``start`` (Dynamo's ``hits_beyond``)."""
    return sum(1 for hit in hits[start:] if hit)


class _Policy:
    """What every policy shares: the index lookup and the choice among logits."""

    name: str

    def __init__(self, index: TierIndex, config: ScoringConfig) -> None:
        self.index = index
        self.config = config
        self.recency = ChoiceRecency()

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        _check(request)
        overlaps = self.index.overlaps(request.page_hashes, [w.url for w in request.workers])
        logits = self._logits(request, overlaps)
        return RouteDecision(
            worker=self._lowest(request.workers, logits), policy=self.name, logits=logits,
            overlaps=overlaps,
        )

    def _lowest(self, workers: Sequence[WorkerLoad], logits: Mapping[str, float],
                digits: int = _TIE_DIGITS, record: bool = True) -> str:
        """Lowest logit (to ``digits`` decimals); ties to fewer active requests, then the
        worker chosen least recently, then registration order. Records the choice unless
        ``record`` is False (the caller may choose another and records that)."""
        recency = self.recency
        best = min(
            range(len(workers)),
            key=lambda i: (round(logits[workers[i].url], digits), workers[i].active_requests,
                           recency.last(workers[i].url), i),
        )
        url = workers[best].url
        if record:
            recency.chose(url)
        return url

    def _logits(
        self, request: RouteRequest, overlaps: Mapping[str, TierOverlap],
    ) -> dict[str, float]:
        raise NotImplementedError


class RoundRobinPolicy(_Policy):
    name = PolicyName.ROUND_ROBIN.value

    def __init__(self, index: TierIndex, config: ScoringConfig) -> None:
        super().__init__(index, config)
        self._turn = itertools.count()

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        _check(request)
        # The overlaps are not used to choose, but recorded: the metrics compare policies.
        overlaps = self.index.overlaps(request.page_hashes, [w.url for w in request.workers])
        worker = request.workers[next(self._turn) % len(request.workers)]
        return RouteDecision(worker=worker.url, policy=self.name, overlaps=overlaps)


class LeastLoadPolicy(_Policy):
    name = PolicyName.LEAST_LOAD.value

    def _logits(
        self, request: RouteRequest, overlaps: Mapping[str, TierOverlap],
    ) -> dict[str, float]:
        # Active requests first; decode blocks break ties (a fraction below one request).
        most = max(w.decode_blocks for w in request.workers) + 1.0
        return {w.url: w.active_requests + w.decode_blocks / most for w in request.workers}


class CacheAwarePolicy(_Policy):
    name = PolicyName.CACHE_AWARE.value

    def _logits(
        self, request: RouteRequest, overlaps: Mapping[str, TierOverlap],
    ) -> dict[str, float]:
        page = _page_size(request)
        weight = self.config.overlap_weight
        if weight is None:
            weight = DYNAMO_OVERLAP_WEIGHT
        return {
            w.url: weight * (request.prompt_tokens - overlaps[w.url].gpu * page) / page
            + w.decode_blocks
            for w in request.workers
        }


class TierAwarePolicy(_Policy):
    name = PolicyName.TIER_AWARE.value

    def __init__(
        self, index: TierIndex, config: ScoringConfig, shared: SharedPoolLookup | None,
        costs: Mapping[str, TierCosts] | None,
    ) -> None:
        super().__init__(index, config)
        self.shared = shared
        self.costs: Mapping[str, TierCosts] = costs if costs is not None else {}
        self._warnings = _RateLimitedWarning(WARNING_INTERVAL_S)
        self.homes = ConversationHomes()

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        _check(request)
        page = _page_size(request)
        overlaps, hits, outcome = await self._lookup(request, token_ids)
        pages = {
            w.url: self.prefill_pages(request, w, overlaps[w.url], hits, page)
            for w in request.workers
        }
        weights = {w.url: self.weight(w) for w in request.workers}
        prefill = {url: weights[url] * p for url, p in pages.items()}
        loads = {w.url: self._load(w) for w in request.workers}
        logits = {url: prefill[url] + loads[url] for url in prefill}
        best = self._lowest(request.workers, logits, record=False)

        def home_fits(home: str) -> bool:
            # Holding no less of the prefix than the best (its prefill term no larger),
            # and busier by no more than this request adds to a worker's load term.
            return (prefill[home] <= prefill[best]
                    and loads[home] <= loads[best] + request.prompt_tokens / page)

        chosen, home = self._home_or(request, best, home_fits)
        # The chosen worker's predicted TTFT from its live cost model: reported beside the
        # measured one (``/decisions``, ``/metrics``) to check the model in production.
        worker = next(w for w in request.workers if w.url == chosen)
        terms, fallbacks = predict_for(request, worker, request.workers, overlaps[chosen],
                                       hits, page)
        return RouteDecision(
            worker=chosen, policy=self.name, logits=logits, overlaps=overlaps,
            shared_hits=None if hits is None else sum(hits),
            shared_beyond=0 if hits is None else hits_beyond(hits, overlaps[chosen].gpu),
            shared_outcome=None if outcome is None else outcome.value, home=home,
            prefill_pages=pages[chosen], overlap_weight=weights[chosen],
            predicted_ttft_s=terms.ttft_s, terms=terms.as_dict(), fallbacks=fallbacks,
        )

    def weight(self, worker: WorkerLoad) -> float:
        """The overlap weight of ``worker``'s prefill pages: the flag's, or derived
        (``overlap_weight`` None): ``1 + prefilling + usage`` (module docstring)."""
        fixed = self.config.overlap_weight
        if fixed is not None:
            return fixed
        usage = 1.0 if worker.cache_usage is None else worker.cache_usage
        return 1.0 + worker.prefilling_requests + usage

    def _load(self, worker: WorkerLoad) -> float:
        if self.config.load_term == LoadTerm.PENDING_PREFILL.value:
            return worker.pending_prefill_pages
        return worker.decode_blocks

    def _home_or(self, request: RouteRequest, best: str,
                 home_fits: Callable[[str], bool]) -> tuple[str, str | None]:
        """The request's home worker when ``home_fits`` it, else the best; and the home
        (None: none among the candidates, or affinity off). Records the choice, and
        makes it the conversation's home."""
        if not self.config.conversation_affinity:
            self.recency.chose(best)
            return best, None
        home = self.homes.home(request.page_hashes)
        if home not in {w.url for w in request.workers}:  # none yet, or not a candidate now
            home = None
        chosen = best
        if home is not None and home != best and home_fits(home):
            chosen = home
        self.recency.chose(chosen)
        self.homes.record(request.page_hashes, chosen)
        return chosen, home

    async def _lookup(
        self, request: RouteRequest, token_ids: Sequence[int],
    ) -> tuple[dict[str, TierOverlap], list[bool] | None, SharedQueryOutcome | None]:
        """The index's overlaps, and the shared pool's flags (None: not asked, late or
        failed) with how its query ended."""
        began = time.monotonic()
        query: asyncio.Future[Sequence[bool]] | None = None
        # The shared pool is named by the workers' default-tenant key seed: a tenant's L3
        # pages have other names, so its requests score from the index (tenant hashes) alone.
        if self.shared is not None and request.page_hashes and request.tenant is None:
            query = await _start_query(self.shared, request.page_hashes, token_ids)
        try:
            overlaps = self.index.overlaps(request.page_hashes, [w.url for w in request.workers])
        except BaseException:
            if query is not None:
                query.cancel()  # no query left running for a decision that failed
                if not query.cancelled():  # it had ended: its outcome is read, and dropped
                    query.exception()
            raise
        hits, outcome = await self._hits(query, began, len(request.page_hashes))
        return overlaps, hits, outcome

    def prefill_pages(
        self, request: RouteRequest, worker: WorkerLoad, overlap: TierOverlap,
        hits: Sequence[bool] | None, page: int,
    ) -> float:
        """The pages of prefill one worker would compute for the request
        (``adjusted_prefill / page``: its logit, less the load term, before the overlap
        weight); ``hits`` None: the shared pool as the index knows it."""
        config = self.config
        host_saves, shared_saves = self._page_savings(request, worker.url)
        prefill_tokens = request.prompt_tokens - config.device_credit * overlap.gpu * page
        host_beyond = overlap.host - overlap.gpu
        if hits is None:
            shared_beyond = max(0, overlap.external - overlap.host)
        else:
            shared_beyond = hits_beyond(hits, overlap.host)
        reduction = (host_saves * host_beyond + shared_saves * shared_beyond) * page
        adjusted_prefill = max(0.0, prefill_tokens - reduction)
        return adjusted_prefill / page

    def _page_savings(self, request: RouteRequest, worker: str) -> tuple[float, float]:
        """Prefill pages saved by one host page and by one shared-pool page."""
        config = self.config
        override = request.shared_cache_multiplier
        if config.tier_costs == TierCostMode.MEASURED.value:
            costs = self.costs.get(worker, TierCosts())
            shared = _unit(1.0 - costs.external) if override is None else override
            return _unit(1.0 - costs.host), shared
        shared = config.shared_cache_multiplier if override is None else override
        return config.host_multiplier, shared

    async def _hits(
        self, query: asyncio.Future[Sequence[bool]] | None, began: float, num_pages: int,
    ) -> tuple[list[bool] | None, SharedQueryOutcome | None]:
        if query is None:
            return None, None
        remaining_s = self.config.shared_deadline_s - (time.monotonic() - began)
        try:
            hits = await asyncio.wait_for(query, timeout=max(0.0, remaining_s))
        except asyncio.TimeoutError:
            self._warnings.warn(
                "shared cache query took over %.0f ms; scoring from the index alone",
                self.config.shared_deadline_s * 1e3,
            )
            return None, SharedQueryOutcome.LATE
        # Whatever the lookup raised, the request is still routed: the failure is logged.
        except Exception as error:
            self._warnings.warn("shared cache query failed (%s); scoring from the index alone",
                                error)
            return None, SharedQueryOutcome.FAILED
        if len(hits) != num_pages:
            self._warnings.warn(
                "shared cache query answered %d flags for %d pages; scoring from the index alone",
                len(hits), num_pages,
            )
            return None, SharedQueryOutcome.FAILED
        return [bool(hit) for hit in hits], SharedQueryOutcome.ANSWERED


async def _start_query(
    shared: SharedPoolLookup, page_hashes: Sequence[int], token_ids: Sequence[int],
) -> asyncio.Future[Sequence[bool]]:
    """The shared pool's query, started before the index walk so that the two overlap.

    A pool that can ``submit`` starts it synchronously: yielding to a busy event loop
    to let a task start cost whole loop iterations of the deadline. A refusal is
    returned as a failed future: the decision goes on from the index alone."""
    submit: Callable[[Sequence[int], Sequence[int]], asyncio.Future[Sequence[bool]]] | None = (
        getattr(shared, "submit", None))
    if submit is None:
        query = asyncio.ensure_future(shared.hits(page_hashes, token_ids))
        await asyncio.sleep(0)  # let it start (a thread-backed lookup hands its work over)
        return query
    try:
        return submit(page_hashes, token_ids)
    except Exception as error:
        failed: asyncio.Future[Sequence[bool]] = asyncio.get_running_loop().create_future()
        failed.set_exception(error)
        return failed


class _RateLimitedWarning:
    """A warning logged at most once per interval, counting the ones held back."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held_back = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more since the last warning)"
        logger.warning(message, *args)
        self._last, self._held_back = now, 0


def build_policy(
    name: str, index: TierIndex, shared: SharedPoolLookup | None, config: ScoringConfig,
    costs: Mapping[str, TierCosts] | None = None,
) -> RoutingPolicy:
    """The policy called ``name``. ``shared``: the shared pool (tier_aware only;
    None: index only). ``costs``: each worker's measured tier costs, by url,
    read at every decision (tier_costs "measured"; a worker missing there is
    priced with the ``TierCosts`` defaults)."""
    try:
        kind = PolicyName(name)
    except ValueError:
        names = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown routing policy {name!r}; choose one of {names}") from None
    if kind is PolicyName.ROUND_ROBIN:
        return RoundRobinPolicy(index, config)
    if kind is PolicyName.LEAST_LOAD:
        return LeastLoadPolicy(index, config)
    if kind is PolicyName.CACHE_AWARE:
        return CacheAwarePolicy(index, config)
    if kind is PolicyName.PREDICTED_TTFT:
        # Imported here: ttft_policy builds on this module's tier_aware.
        from hicache.router.ttft_policy import PredictedTTFTPolicy

        return PredictedTTFTPolicy(index, config, shared, costs)
    return TierAwarePolicy(index, config, shared, costs)


def _check(request: RouteRequest) -> None:
    if not request.workers:
        raise NoWorkerError("no healthy worker to route the request to")
    if request.prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {request.prompt_tokens}")
    multiplier = request.shared_cache_multiplier
    if multiplier is not None and not multiplier >= 0:
        raise ValueError(f"shared_cache_multiplier must be a number >= 0, got {multiplier}")


def _page_size(request: RouteRequest) -> int:
    if request.page_size is None or request.page_size <= 0:
        raise ValueError(
            f"RouteRequest.page_size must be the workers' page size (> 0), got "
            f"{request.page_size}: the scoring policies count prefill in pages"
        )
    return request.page_size


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


class ChoiceRecency:
    """When a policy last chose each worker, as a count of its choices (the policy's
    event loop only): 0 for a worker never chosen."""

    def __init__(self) -> None:
        self._count = itertools.count(1)
        self._last: dict[str, int] = {}

    def last(self, url: str) -> int:
        return self._last.get(url, 0)

    def chose(self, url: str) -> None:
        self._last[url] = next(self._count)
