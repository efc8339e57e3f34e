"""The decode instance's side of disaggregation, on the scheduler thread.

A request with a bootstrap room is not computed here: it gets device pages for
its prompt (``advance``, in arrival order, while the pool has room) and waits,
held out of the batch, while the receiver's thread tells the prefill instance
where those pages are and waits for them to be written. When the receiver
reports (``on_received``, run between steps) the request joins the decode batch
with the prompt's KV in place and the prefill instance's first token as its first
output; if the transfer failed it finishes aborted and its pages are freed.

With ``offload`` the request holds an (empty) prefix of the radix tree, so that
when it finishes its whole KV, prompt and output, goes to the tree like any
request's: written through to L2 and backed up to L3 under the page keys a
prefill instance computes for the same tokens.

It sees the scheduler through ``IntakeHost`` (the request lifecycle): its cache and
limits, how many requests run, and three operations: set a request's stop
conditions, let a request whose KV landed join the decode batch, end a held request.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Protocol

import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.disaggregation.kv_receiver import KVReceiver, ReceiveJob
from hicache.engine.api import LogprobParams, TokenLogprob
from hicache.engine.config import SchedulerLimits
from hicache.engine.logprobs import received_logprobs
from hicache.engine.penalties import PenaltyState
from hicache.engine.request import Phase, Req
from hicache.engine.sampling import is_greedy
from hicache.memory.allocator import OutOfPagesError

logger = logging.getLogger(__name__)


class IntakeHost(Protocol):
    """What the intake reads of the scheduler and does to its requests
    (``RequestLifecycle``)."""

    @property
    def cache(self) -> HierarchicalCache: ...

    @property
    def limits(self) -> SchedulerLimits: ...

    @property
    def num_running(self) -> int: ...

    def set_stop_conditions(self, req: Req) -> None: ...

    def join_decode(self, req: Req, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """Into the decode batch, its prompt's KV in place, ``first_token`` its first output."""

    def finish_held(
        self, req: Req, reason: str, error: str | None = None, flush_text: bool = True
    ) -> None:
        """End a request held outside the queues (its pages, if any, freed or cached)."""


class DecodeIntake:
    def __init__(
        self, host: IntakeHost, receiver: KVReceiver, offload: bool, vocab_size: int
    ) -> None:
        self.host = host
        self.receiver = receiver
        self.offload = offload
        self.vocab_size = vocab_size  # the model's (a penalised request's state spans it)
        self.pending: deque[Req] = deque()  # not yet given pages
        self.awaiting: dict[str, Req] = {}  # pages given, KV on its way
        self.aborted: set[str] = set()  # awaiting requests the client gave up

    @property
    def num_held(self) -> int:
        return len(self.pending) + len(self.awaiting)

    def add(self, req: Req) -> None:
        self.pending.append(req)

    def advance(self) -> None:
        """Give pages to pending requests, first come first served, while the pool and
        the page table have room for them beside the running requests."""
        host = self.host
        cache = host.cache
        limit = host.limits.max_running_requests
        while self.pending:
            running = host.num_running
            if running + len(self.awaiting) >= limit:
                return
            req = self.pending[0]
            num_pages = -(-req.prompt_len // cache.page_size)
            # Running requests keep a page each to grow into.
            reserve = running
            room = cache.device_pool.allocator.num_free_pages \
                + cache.tree.num_evictable_device_pages
            if num_pages + reserve > room and (running or self.awaiting):
                return
            try:
                pages = cache.alloc_device(num_pages)
            except OutOfPagesError:
                return
            self.pending.popleft()
            req.pages = pages
            req.owned_from = 0
            req.num_computed = 0
            req.phase = Phase.PREFILL  # its prompt is being filled in, from afar
            self.awaiting[req.rid] = req
            bootstrap = req.request.bootstrap
            assert bootstrap is not None
            self.receiver.receive(
                ReceiveJob(req.rid, bootstrap.host, bootstrap.port, bootstrap.room, pages)
            )

    def abort(self, rid: str) -> bool:
        """True when ``rid`` is held here (then it ends here, soon)."""
        for req in self.pending:
            if req.rid == rid:
                self.pending.remove(req)
                bootstrap = req.request.bootstrap
                assert bootstrap is not None
                self.receiver.give_up(bootstrap.host, bootstrap.port, bootstrap.room)
                self._end(req, "abort", None)
                return True
        if rid in self.awaiting:
            # Its pages may be being written to: the receiver gives the room up, and the
            # request ends when it reports.
            self.aborted.add(rid)
            self.receiver.cancel(rid)
            return True
        return False

    def on_received(
        self, rid: str, first_token: int | None, logprobs: dict[str, Any] | None,
        error: str | None,
    ) -> None:
        """The receiver's report, on the scheduler thread."""
        req = self.awaiting.pop(rid, None)
        if req is None:
            logger.error("KV arrived for request %s, which is not waiting for it", rid)
            return
        if rid in self.aborted:
            self.aborted.discard(rid)
            self._end(req, "abort", None)
            return
        if error is not None or first_token is None:
            self._end(req, "abort", error or "the prefill instance sent no first token")
            return
        first_logprob: TokenLogprob | None = None
        params = req.request.logprobs
        if params is not None:
            try:
                first_logprob = self._take_logprobs(req, params, logprobs, first_token)
            except ValueError as bad:
                self._end(req, "abort", str(bad))
                return
        self._join_batch(req, first_token, first_logprob)

    @staticmethod
    def _take_logprobs(
        req: Req, params: LogprobParams, data: dict[str, Any] | None, first_token: int
    ) -> TokenLogprob:
        """The prompt's logprobs (into ``req``) and the first token's, as the prefill
        instance computed them; ValueError when it sent none or not the ones asked for."""
        if data is None:
            raise ValueError("the request asked for logprobs, and the prefill instance sent "
                             "none (is it an older hicache?)")
        input_logprobs, first = received_logprobs(data, params)
        if first.token_id != first_token:
            raise ValueError(f"the prefill instance sent the logprobs of token {first.token_id} "
                             f"with first token {first_token}")
        expected = req.prompt_len - params.input_from if params.wants_input(req.prompt_len) else 0
        if len(input_logprobs) != expected:
            raise ValueError(f"the prefill instance sent {len(input_logprobs)} prompt logprobs "
                             f"where this request asks for {expected}")
        req.input_logprobs = input_logprobs
        req.logprob_next = req.prompt_len  # none left to compute here
        return first

    def _join_batch(self, req: Req, first_token: int, first_logprob: TokenLogprob | None) -> None:
        host = self.host
        params = req.request.sampling
        host.set_stop_conditions(req)
        req.num_computed = req.prompt_len
        if params.has_penalties:
            # Made before the first token is appended, so that it counts that token too.
            req.penalties = PenaltyState(
                req.request.input_ids if params.repetition_penalty != 1.0 else (),
                self.vocab_size, host.cache.device_pool.device,
            )
        generator = req.generator
        if generator is not None and not is_greedy(params):
            # The prefill instance drew the first token with the uniform a plain server
            # takes first from the request's generator: skip it, so that a seeded request
            # draws every later token as a plain server does.
            torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
        if self.offload and host.limits.enable_prefix_cache:
            req.hit = host.cache.acquire([], req.request.extra_key, record_hit=False)
        host.join_decode(req, first_token, first_logprob)

    def _end(self, req: Req, reason: str, error: str | None) -> None:
        """Finish a request that never joined the batch; its pages (if any) are freed."""
        self.host.finish_held(req, reason, error=error, flush_text=False)

    def fail_all(self, message: str) -> None:
        for req in [*self.pending, *self.awaiting.values()]:
            self._end(req, "abort", message)
        self.pending.clear()
        self.awaiting.clear()
