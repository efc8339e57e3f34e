"""A request's way through the scheduler once it arrived: queued, running, finished.

``RequestLifecycle`` owns the two queues (``waiting``: FIFO, a retracted request back
at its front; ``running``: prefilling and decoding requests, in admission order) and
every change of a request's state after admission. The scheduler queues arrivals and
admits (moves a request from ``waiting`` to ``running``); the rest is here: each
output token appended and checked against the request's stop conditions (its stop
tokens, its stop strings, its grammar's end, its length limit), the write-through of
its prompt's whole pages after prefill, the device pages it grows into (the newest
other request retracted when the pool is short), retraction, and its finish.

Invariants:

- a request not finished is in exactly one of ``waiting`` and ``running``, or held
  outside both by a disaggregation hook (a decode instance's until its KV lands, a
  prefill instance's while its KV is sent: ``detach``), which ends it through
  ``finish_held`` or lets it join the batch (``join_decode``);
- ``finish`` ends a request once (a finished one is left alone): a request that held
  device pages gives its computed whole pages to the radix tree (its KV is valid,
  and the next turn of the conversation wants it) and frees the rest, releases its
  cached prefix and its page-table row, and its final output goes to ``outputs``;
- a request's text, when the scheduler detokenizes it (stop strings), never holds a
  stop string: it is cut at the first one, searched only where one could end in text
  not searched before;
- a running request short of device pages takes them from the newest other running
  request (retracted: its KV to the tree, requeued first); a prefilling request short
  while running alone, whose missing pages can only be held by copies or L3 backups
  in flight, is requeued likewise, tick after tick, until they land, and fails only
  after ``SHORT_OF_PAGES_ABORT_S`` of the ticks' clock;
- the counters count each request's arrival and end once, and every output token.

Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.engine.api import TokenLogprob
from hicache.engine.config import SchedulerLimits
from hicache.engine.counters import EngineCounters
from hicache.engine.model_runner import ModelRunner
from hicache.engine.output_thread import OutputThread
from hicache.engine.penalties import ending_tokens
from hicache.engine.prefetcher import Prefetcher
from hicache.engine.request import Phase, Req
from hicache.memory.allocator import OutOfPagesError

if TYPE_CHECKING:
    from hicache.engine.pd_prefill import PrefillHandoff

logger = logging.getLogger(__name__)

# A request running alone that cannot get device pages for this long is failed: the
# pages it waits for (held by copies and L3 backups in flight) come back far sooner.
SHORT_OF_PAGES_ABORT_S = 30.0


class RequestLifecycle:
    def __init__(
        self,
        cache: HierarchicalCache,
        runner: ModelRunner,
        limits: SchedulerLimits,
        eos_token_ids: frozenset[int],
        outputs: OutputThread,
        prefetcher: Prefetcher,
        counters: EngineCounters,
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.limits = limits
        self.page_size = cache.page_size
        self.eos_token_ids = eos_token_ids
        self.outputs = outputs
        self.prefetcher = prefetcher
        self.counters = counters
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._by_rid: dict[str, Req] = {}  # every request not finished, by rid
        # A prefill instance's (``engine/disaggregation.py`` sets it): a request that
        # finishes at its first token hands its KV off to a decode instance first.
        self.prefill_handoff: PrefillHandoff | None = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------- arrival
    def arrive(self, req: Req) -> None:
        """Count ``req`` and make it findable by rid (the caller queues it)."""
        self._by_rid[req.rid] = req
        self.counters.num_requests += 1

    def find(self, rid: str) -> Req | None:
        """The request ``rid`` if it has not finished."""
        return self._by_rid.get(rid)

    def set_stop_conditions(self, req: Req) -> None:
        """Its stop tokens and length limit, set once, at its first admission."""
        params = req.request.sampling
        req.stop_ids = frozenset(ending_tokens(params, self.eos_token_ids))
        req.length_limit = min(req.prompt_len + params.max_new_tokens,
                               self.limits.max_context_len)

    # ------------------------------------------------------ prefill, decode
    def end_prefill(self, req: Req) -> bool:
        """Its prompt is computed: it decodes from now on, its prompt's whole pages in the
        tree. False when that finished it (no token asked for)."""
        req.phase = Phase.DECODE
        self._cache_prefill(req)
        if req.request.sampling.max_new_tokens == 0:
            # Prefill only (clients warm the cache this way): the prompt is computed and
            # cached, no token is produced.
            self.finish(req, "length")
            return False
        return True

    def join_decode(self, req: Req, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """Admit a request whose prompt's KV was written into its pages from elsewhere (a
        prefill instance) straight into decoding, with the first token computed there."""
        self.counters.num_prompt_tokens += req.prompt_len
        self.runner.admit(req)
        self.running.append(req)
        req.phase = Phase.DECODE
        req.first_token_at = time.monotonic()
        if first_logprob is not None:
            req.output_logprobs.append(first_logprob)
        try:
            self.append_token(req, first_token)
        except Exception as error:  # one request's fault must not fail the others
            self.token_failed(req, error)

    def append_token(self, req: Req, token: int) -> None:
        """Append one output token and stream it, or finish the request if it stops it."""
        grammar = req.grammar
        # Before the token is appended: a token its grammar rejects fails the request with
        # its output and matcher still in step. (The mask lets none through; a prefill
        # instance's first token or a forced one could be.)
        if grammar is not None and not grammar.accept(token):
            raise RuntimeError(f"token {token} does not match the request's grammar")
        output_ids = req.output_ids
        output_ids.append(token)
        if req.penalties is not None:
            req.penalties.add(token)
        self.counters.num_generated_tokens += 1
        num_out = len(output_ids)
        reason: str | None = None
        stop_string = False
        # Under min_new_tokens nothing stops it (SGLang's rule); its ending tokens were
        # masked, but one may still be forced (every other logit -inf).
        may_stop = num_out >= req.request.sampling.min_new_tokens
        if token in req.stop_ids and may_stop:
            reason = "stop"
        elif grammar is not None and grammar.terminated:
            reason = "stop"  # (its end-of-sequence token with ignore_eos: nothing may follow)
        elif req.scheduler_text:
            req.text += req.detokenizer.push(token)
            if not may_stop:
                req.scanned_chars = len(req.text)  # no stop string counts in this text
            elif _cut_at_stop(req):
                reason, stop_string = "stop", True
        if reason is None and req.prompt_len + num_out >= req.length_limit:
            reason = "length"
        if reason is not None:
            self.finish(req, reason, flush_text=not stop_string)
        else:
            self.outputs.add(req, final=False)

    def token_failed(self, req: Req, error: Exception) -> None:
        """Producing ``req``'s next token raised: fail it alone."""
        logger.exception("request %s failed while producing its next token", req.rid)
        self.fail(
            req, f"internal error producing the next token: {type(error).__name__}: {error}"
        )

    def fail(self, req: Req, error: str) -> None:
        """Finish ``req`` aborted with ``error`` (its text as it is), unless it finished."""
        if req.phase is not Phase.FINISHED:
            self.finish(req, "abort", flush_text=False, error=error)

    # ------------------------------------------------------ device pages
    def ensure_pages(self, req: Req, num_tokens: int, now: float) -> bool:
        """Pages for ``num_tokens`` tokens of context for a running request; when the pool
        is short, the newest other request is retracted (or this one, when none is left).
        False when it has no pages for them (retracted, or failed at ``now``, the tick's
        clock, after waiting alone for pages longer than SHORT_OF_PAGES_ABORT_S)."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        while need > 0:
            try:
                self.runner.grow(req, self.cache.alloc_device(need))
                req.short_since = None
                return True
            except OutOfPagesError:
                victim = self._retraction_victim(exclude=req)
                if victim is None:
                    if req.phase is Phase.DECODE or len(self.running) > 1:
                        self.retract(req)
                        return False
                    # Alone and still short. Every validated request fits the empty pool,
                    # so what holds the pages is in flight: copies to L2, or L3 backups
                    # pinning the host pages that write_back needs to evict into. A coming
                    # poll releases them: wait, requeued. Only a shortage that never ends
                    # (a leak) fails the request.
                    if req.short_since is None:
                        req.short_since = now
                    if now - req.short_since < SHORT_OF_PAGES_ABORT_S:
                        self.retract(req)
                        return False
                    self.finish(req, "abort", error="the device KV pool stayed too full for it")
                    return False
                self.retract(victim)
        return True

    def _retraction_victim(self, exclude: Req) -> Req | None:
        candidates = [r for r in self.running if r is not exclude]
        return max(candidates, key=lambda r: r.arrived) if candidates else None

    def retract(self, req: Req) -> None:
        """Out of device pages: give the request's KV to the tree and requeue it first."""
        self._release(req, keep_kv=True)
        req.phase = Phase.WAITING
        req.num_retractions += 1
        self.counters.num_retractions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def detach(self, req: Req) -> None:
        """Take a running request out of the batch and its page-table row, its pages held
        (its KV is being sent elsewhere); ``finish_held`` ends it."""
        self.running.remove(req)
        self.runner.release(req)

    def _cache_prefill(self, req: Req) -> None:
        """Write-through after prefill: the prompt's whole pages go to the tree now."""
        if not self.limits.enable_prefix_cache or req.hit is None:
            return
        full = req.num_computed // self.page_size
        if full <= req.owned_from:
            return
        tokens = req.tokens()[: full * self.page_size]
        req.hit = self.cache.insert_held(tokens, req.pages[:full], req.hit, req.request.extra_key)
        self.runner.replace(req, np.concatenate([req.hit.device_pages, req.pages[full:]]))
        req.owned_from = full

    def _release(self, req: Req, keep_kv: bool) -> None:
        """Hand computed whole pages to the tree (if ``keep_kv``), free the rest, unlock."""
        cache = self.cache
        pages = req.pages
        if keep_kv and self.limits.enable_prefix_cache and req.hit is not None:
            full = min(req.num_computed // self.page_size, len(pages))
            if full > req.owned_from:
                tokens = req.tokens()[: full * self.page_size]
                cache.insert(tokens, pages[:full], req.request.extra_key)
                # The tree owns pages[:full] now (or freed them as duplicates).
                cache.free_device(pages[full:])
            else:
                cache.free_device(pages[req.owned_from :])
        else:
            cache.free_device(pages[req.owned_from :])
        if req.hit is not None:
            cache.release(req.hit)
        self.runner.release(req)
        req.hit = None
        req.pages = np.empty(0, dtype=np.int64)
        req.owned_from = 0
        req.num_computed = 0

    # -------------------------------------------------------------- the end
    def finish(
        self, req: Req, reason: str, error: str | None = None, flush_text: bool = True
    ) -> None:
        """End ``req`` (``reason``: stop, length or abort) and send its final output."""
        if req.phase is Phase.FINISHED:
            return
        if self.prefill_handoff is not None and self.prefill_handoff.intercept_finish(
            req, reason, error
        ):
            return  # its KV goes to a decode instance first (then on_sent finishes it)
        if flush_text and req.scheduler_text:
            # Text held back for an unfinished character is released at the end. First,
            # before anything is freed: a detokenizer failing here leaves the request
            # whole, for the caller to finish without it. (The output thread flushes the
            # detokenizers of requests without stop strings.)
            req.text += req.detokenizer.flush()
            if _cut_at_stop(req):
                reason = "stop"
        self.prefetcher.cancel(req)
        phase = req.phase
        # Its own hints are about what its KV covers: the tokens computed (the last output
        # token never is), or its prompt when it never ran.
        hinted = req.token_slice(0, req.num_computed) if phase is not Phase.WAITING else list(
            req.request.input_ids
        )
        if phase is not Phase.WAITING:
            # Keep the KV of a request that finished (or was aborted) mid-way: it
            # is valid, and the next turn of the conversation will want it.
            self._release(req, keep_kv=True)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.request.hints:
            self._apply_own_hints(req, hinted)
        req.phase = Phase.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_at = time.monotonic()
        self._by_rid.pop(req.rid, None)
        if reason == "abort":
            self.counters.num_aborted += 1
            self._count_abort(phase)
        else:
            self.counters.num_finished += 1
        self.outputs.add(req, final=True)

    def _apply_own_hints(self, req: Req, tokens: list[int]) -> None:
        """Its hints, now that its KV is in the tree; one's failure fails none."""
        try:
            req.hint_outcomes = self.cache.hints.apply(
                req.request.hints, own_tokens=tokens, own_extra_key=req.request.extra_key
            )
        except Exception:  # the request's output still goes out
            logger.exception("the hints of request %s failed", req.rid)

    def finish_held(
        self, req: Req, reason: str, error: str | None = None, flush_text: bool = True
    ) -> None:
        """End a request a disaggregation hook holds outside the queues: it goes back to
        the queue its phase names, from which ``finish`` takes it (freeing any pages)."""
        if req.phase is Phase.WAITING:
            self.waiting.append(req)
        else:
            self.running.append(req)
        self.finish(req, reason, error=error, flush_text=flush_text)

    def finish_all(self, message: str) -> None:
        """Abort every queued request with ``message`` (shutting down, or a failed step)."""
        for req in [*self.running, *self.waiting]:
            try:
                self.finish(req, "abort", error=message)
            except Exception:  # keep failing the others
                logger.exception("could not finish request %s cleanly", req.rid)

    def _count_abort(self, phase: Phase) -> None:
        counters = self.counters
        if phase is Phase.WAITING:
            counters.num_aborted_waiting += 1
        elif phase is Phase.PREFILL:
            counters.num_aborted_prefill += 1
        else:
            counters.num_aborted_decode += 1


def _cut_at_stop(req: Req) -> bool:
    """Trim the text at the first stop string; True when there was one."""
    cut = _find_stop(req.text, req.request.sampling.stop, req.scanned_chars)
    if cut is None:
        req.scanned_chars = len(req.text)
        return False
    req.text = req.text[:cut]
    return True


def _find_stop(text: str, stops: tuple[str, ...], scanned: int) -> int | None:
    """Index where the earliest stop string starts in ``text``, searching only where one
    could end past ``text[:scanned]`` (searched before, with none found)."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, scanned - len(stop) + 1))
        if index >= 0 and (best is None or index < best):
            best = index
    return best
