"""The L3 prefetches of waiting requests: started on arrival, within a host budget.

A request's prefetch starts when it arrives (each admission round, every
waiting request whose prefetch has not been tried), so that its time in the
queue hides the fetch, as SGLang does. What has landed joins the radix tree as
host pages when the prefetch is settled: when it is done, or when the request
is considered for admission and the prefetch policy lets it start.
A request whose L3 lookup has not answered is held; an admission round waits a few
milliseconds (``LOOKUP_WAIT_S``) for the lookups it posted rather than leave the new
requests out of the forward that follows. Likewise for the reads: a request held for
pages still being read would sit out the next forward of the requests running beside
it, and the round waits for its read where that costs less than it saves (the wait the
scheduler gives ``advance``: a share of the next step's predicted time).

Waiting requests take host pages for their prefetches only up to the L3
tier's budget (``prefetch_max_host_fraction`` of the host pool), counting what
their settled prefetches brought: a long queue neither takes the whole host
pool (write_back evicts device pages into it, backups copy into it) nor evicts
its own prefetched pages before they are used. Runs on the scheduler thread.

What the local tiers held of a waiting request's prefix can leave the host before it is
admitted: under load the queue lasts several prefills, whose backups evict host pages
(pages that only a prefetch brought are not in the core set, so they go first); and a
prefetch that found its pages in L3 when no host page was free for them lands nothing. A
request found holding fewer prefix pages at admission than it once had, or than L3 was
found to hold, fetches them from L3 once more, rather than recompute what L3 still has
(``settled``).

Under tensor parallelism at most ``l3_agreement.NUM_SLOTS`` prefetches run at
once (each is agreed through a slot of the per-tick collective); a request
whose prefetch finds no free slot waits, as it would for the host budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.engine.request import Req
from hicache.engine.reuse_plan import CostSnapshot

# The longest an admission round waits for the L3 lookups of the requests it considers,
# all together. A request whose lookup has not answered is held (L3 may hold its prompt),
# and the lookup of one that arrived during the last forward is posted only in this
# round: without the wait every request would sit out one forward of the others (a cold
# prompt's TTFT grew by about a step beside three others in flight). A local file store
# answers in well under a millisecond, Mooncake in about one round trip; a store slower
# than this costs its requests that step, as before.
LOOKUP_WAIT_S = 0.01
# The longest an admission round waits for L3 reads, all together, however long the step
# that follows: past it a read is slow enough to be worth its own step.
MAX_READ_WAIT_S = 0.25


def read_wait_s(costs: CostSnapshot, prompt_tokens: int, decode_rows: int,
                running: int) -> float:
    """What an admission round may wait for the reads of the requests it holds, before a
    step of ``prompt_tokens`` prompt tokens and ``decode_rows`` decode rows over
    ``running`` requests, priced with the live costs.

    A held request whose read lands within the wait joins that step rather than the one
    after it: it gains about the step's time, and each of the ``running`` requests loses
    the wait. So the wait pays while it is under step / (running + 1); an idle engine
    (nothing running) holds nothing up and polls its reads anyway: 0. Unknown costs: 0.
    """
    if running <= 0:
        return 0.0
    if prompt_tokens > 0:
        step = costs.prefill_s(prompt_tokens, 0, decode_rows)
    else:
        step = costs.step.decode_step_s if costs.step is not None else None
    if step is None or step <= 0:
        return 0.0
    return min(MAX_READ_WAIT_S, step / (running + 1))


class Prefetcher:
    def __init__(self, cache: HierarchicalCache, enabled: bool) -> None:
        self.cache = cache
        self.enabled = enabled  # prefix caching on (L3 may still be detached)
        # Asked, for a request its prefetch policy would still hold, whether the pages to
        # come are worth waiting for (the load-or-recompute plan, ``reuse.py``); None:
        # the policy alone decides.
        self.worth_waiting: Callable[[Req], bool] | None = None
        # What the current admission round may still wait for lookups (``LOOKUP_WAIT_S``)
        # and for reads (the scheduler's ``read_wait_s``).
        self._lookup_wait_left = 0.0
        self._read_wait_left: float | None = 0.0  # None: not priced yet this round
        self._read_wait: Callable[[], float] | None = None

    def advance(self, waiting: Iterable[Req],
                read_wait: Callable[[], float] | None = None) -> None:
        """Start the prefetches of waiting requests as the budget allows; settle the done ones.
        ``read_wait``: prices what this admission round may wait, in all, for the reads
        of the requests it holds, asked once when one is first held (None: no wait).

        Every done prefetch is settled, not only those ahead of the first request
        that does not fit: a prefetch protects the host prefix it extends until it
        is settled, and requests queued behind a starved one must not pin host
        memory that it needs (neither would move).
        """
        cache = self.cache
        self._lookup_wait_left = LOOKUP_WAIT_S
        self._read_wait_left, self._read_wait = (None, read_wait) if read_wait else (0.0, None)
        if not self.enabled or cache.storage is None:
            return
        queue = list(waiting)
        budget_pages = cache.prefetch_budget_pages
        used_pages = sum(self._footprint_pages(req) for req in queue)
        may_start = True  # FIFO: once one does not fit the budget, later ones wait too
        for req in queue:
            if req.prefetch is not None and cache.prefetch_done(req.prefetch):
                used_pages -= self._footprint_pages(req)
                self._settle(req)
                used_pages += self._footprint_pages(req)
            elif may_start and not req.prefetch_tried:
                if not cache.prefetch_slot_free:  # tensor parallelism: wait for a slot
                    may_start = False
                    continue
                # Only whole: one started past the budget would get the pages left (the
                # tier caps them), a short prefix of what it could have had later.
                wanted = cache.prefetch_wanted_pages(req.match_key(), req.request.extra_key)
                if used_pages and used_pages + wanted > budget_pages:
                    may_start = False
                    continue
                self._start(req)
                used_pages += self._footprint_pages(req)

    def settled(self, req: Req) -> bool:
        """For a request considered for admission: True when its prefetch policy lets it run,
        or when the pages still to come are not worth waiting for (``worth_waiting``).

        Its prefetch starts now if it has not, whatever the budget of the waiting
        ones: the L3 tier still caps the host pages it gets.
        """
        if not req.prefetch_tried:
            if self.enabled and not self.cache.prefetch_slot_free:
                return False  # tensor parallelism: it waits until a prefetch ahead settles
            self._start(req)
        elif req.prefetch is None:
            cached = self._lost_prefix(req)
            if cached is not None:
                self._refetch(req, cached)
        if req.prefetch is None:
            return True
        if self._lookup_wait_left > 0 and req.prefetch.op.num_existing < 0:
            began = time.monotonic()
            self.cache.await_prefetch_lookup(req.prefetch, self._lookup_wait_left)
            self._lookup_wait_left -= time.monotonic() - began
        if self._held(req):
            if self._read_wait_left is None:
                assert self._read_wait is not None
                self._read_wait_left = max(0.0, self._read_wait())
            if self._read_wait_left <= 0:
                return False
            began = time.monotonic()
            landed = self.cache.await_prefetch_read(req.prefetch, self._read_wait_left)
            self._read_wait_left -= time.monotonic() - began
            if not landed or self._held(req):
                return False
        self._settle(req)
        return True

    def _held(self, req: Req) -> bool:
        """Does its prefetch still hold it? The policy is an upper bound: the plan may cut
        the prefetch sooner, where what has landed plus computing the rest beats waiting
        for the pages still to come."""
        assert req.prefetch is not None
        return not self.cache.prefetch_ready(req.prefetch) and (
            self.worth_waiting is None or self.worth_waiting(req)
        )

    def cancel(self, req: Req) -> None:
        """The request ends before its prefetch settled: drop what it fetched."""
        if req.prefetch is not None:
            self.cache.cancel_prefetch(req.prefetch)
            req.prefetch = None

    def _start(self, req: Req) -> None:
        req.prefetch_tried = True
        if self.enabled and self.cache.storage is not None:
            tokens, key = req.match_key(), req.request.extra_key
            req.prefix_pages_seen = max(req.prefix_pages_seen, self._cached_pages(req))
            req.prefetch = self.cache.prefetch(tokens, key)

    def _lost_prefix(self, req: Req) -> int | None:
        """The pages of a waiting request's prefix cached now, when fewer than it was seen
        to have and it may fetch them again (once, on its first admission, with L3
        attached and a slot free); else None."""
        cache = self.cache
        if (
            req.refetched or req.num_retractions or req.prefix_pages_seen <= 0
            or not self.enabled or cache.storage is None or not cache.prefetch_slot_free
        ):
            return None
        cached = self._cached_pages(req)
        return cached if cached < req.prefix_pages_seen else None

    def _refetch(self, req: Req, cached_pages: int) -> None:
        req.refetched = True
        # Of what its prefetch brought, only the pages still cached count (the rest left).
        kept = max(0, cached_pages - req.storage_from_page) * self.cache.page_size
        req.storage_tokens = min(req.storage_tokens, kept)
        req.prefetch = self.cache.prefetch(req.match_key(), req.request.extra_key)

    def _cached_pages(self, req: Req) -> int:
        peek = self.cache.peek(req.match_key(), req.request.extra_key)
        return peek.num_device_pages + peek.num_host_pages

    def _settle(self, req: Req) -> None:
        """End the prefetch: what landed joins the tree as host pages."""
        handle = req.prefetch
        assert handle is not None
        found = handle.num_found_tokens
        inserted = self.cache.finish_prefetch(handle)
        if inserted and not req.storage_tokens:
            req.storage_from_page = handle.start_page
        req.storage_tokens += inserted
        # What L3 held counts as seen even where no host page was free for it then (a
        # long queue's prefetches fill their budget): at admission there may be room.
        got = max(inserted, found)
        if got > 0:
            req.prefix_pages_seen = max(
                req.prefix_pages_seen, handle.start_page + got // self.cache.page_size
            )
        req.prefetch = None

    def _footprint_pages(self, req: Req) -> int:
        """Host pages a waiting request's prefetch holds or may take (0 once admitted)."""
        if req.prefetch is not None:
            return self.cache.prefetch_pages(req.prefetch)
        if req.num_retractions:
            return 0  # its prefetched pages were used when it was admitted
        return req.storage_tokens // self.cache.page_size
