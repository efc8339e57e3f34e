"""The scheduler: continuous batching over the hierarchical cache, on one thread.

Each step:
1. take new requests, aborts and control calls from the inbox;
2. ``cache.poll()``: acknowledge landed copies, advance L3 prefetches/backups;
3. start the L3 prefetch of every request that arrived (within a host-page
   budget), so that queueing hides it; admit waiting requests (FIFO) whose
   prefetch the policy lets start, while the device pool can hold their
   context: only then match and lock the cached prefix (host hits start
   loading layer by layer) and count the hit, once per request;
4. one forward over every decoding request (one token each) plus prompt
   chunks of prefilling requests (at most ``chunked_prefill_size`` tokens);
   a failure of the forward fails the running requests;
5. sample every row at once (one host sync), then stream and finish each
   request on its own (a failure there fails that request alone): a finished
   request gives its KV to the radix tree;
6. the KV events the step's cache changes produced go out as one batch.

The thread does no blocking I/O: L2 copies run on the cache controller's
streams/threads and L3 on the storage controller's threads. When the device
pool runs dry for decodes, the newest request is retracted (its KV goes to the
tree, so it resumes mostly from cache).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.engine.api import CachedTokens
from hicache.engine.cache_ops import CACHE_OPS, RANK_READS
from hicache.engine.config import SchedulerLimits
from hicache.engine.logprobs import position_logprobs
from hicache.engine.model_runner import ModelRunner
from hicache.engine.output_thread import DiscardedOutputs, OutputThread
from hicache.engine.pd_decode import DecodeIntake
from hicache.engine.pd_prefill import PrefillHandoff
from hicache.engine.penalties import PenaltyState, RowAdjustment, adjust_logits, ending_tokens
from hicache.engine.prefetcher import Prefetcher
from hicache.engine.request import Phase, Req
from hicache.engine.sampling import sample_tokens
from hicache.engine.thread_governor import ThreadGovernor
from hicache.engine.threads import set_thread_count
from hicache.memory.allocator import OutOfPagesError
from hicache.model.model import CausalLM

logger = logging.getLogger(__name__)

# A request running alone that cannot get device pages for this long is failed: the
# pages it waits for (held by copies and L3 backups in flight) come back far sooner.
SHORT_OF_PAGES_ABORT_S = 30.0


@dataclass
class EngineCounters:
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    # The same aborts by the phase each request was in: waiting ones cost no prefill,
    # so these show whether abandoned requests are dropped before any compute.
    num_aborted_waiting: int = 0
    num_aborted_prefill: int = 0
    num_aborted_decode: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_device_tokens: int = 0
    num_cached_host_tokens: int = 0
    num_cached_storage_tokens: int = 0
    num_retractions: int = 0
    num_steps: int = 0
    # Steps that computed prompt tokens: those tokens and the steps' wall time (decode
    # rows riding along included), whose ratio a router reads as this worker's prefill rate.
    num_prefill_step_tokens: int = 0
    prefill_step_seconds: float = 0.0


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        cache: HierarchicalCache,
        config: SchedulerLimits,
        eos_token_ids: Iterable[int],
        output_thread: bool = True,
        deliver_outputs: bool = True,
    ) -> None:
        """``deliver_outputs`` False: outputs are dropped (a tensor-parallel follower rank,
        whose requests rank 0 streams)."""
        self.model = model
        self.cache = cache
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = cache.device_pool.device
        self.page_size = cache.page_size
        self.counters = EngineCounters()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefilling and decoding, in admission order
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._by_rid: dict[str, Req] = {}
        self.prefetcher = Prefetcher(cache, enabled=config.enable_prefix_cache)
        # Outputs are recorded in it per step and flushed to its thread after each step
        # (``run``), which detokenizes and streams them; a failed detokenizer aborts.
        self.outputs = (
            OutputThread(on_failure=self.abort, threaded=output_thread) if deliver_outputs
            else DiscardedOutputs()
        )
        self.runner = ModelRunner(
            model, cache.device_pool, config.max_running_requests, config.max_context_len
        )
        # The tick's clock (time.monotonic()'s reading when the tick began): every
        # time-based decision reads it, so that ranks fed rank 0's reading decide alike.
        self.now = time.monotonic()
        # Picks torch's intra-op threads between steps (None: the count stays as set).
        self.governor: ThreadGovernor | None = None
        self._threads = 0  # the count last set for a step (0: none yet)
        # Sees the logits each sampled token came from (tests compare cold and cached runs).
        self.logits_observer: Callable[[str, torch.Tensor], None] | None = None
        # Disaggregation (engine/disaggregation.py sets one of them): a prefill instance
        # hands its requests' KV off, a decode instance takes requests whose KV comes.
        self.prefill_handoff: PrefillHandoff | None = None
        self.decode_intake: DecodeIntake | None = None

    # ------------------------------------------------------- thread-safe API
    def submit(self, req: Req) -> None:
        self._inbox.put(("add", req))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the scheduler thread between steps.

        Under tensor parallelism it runs on rank 0 alone: ``fn`` must not change what
        the ranks replicate (the cache, the queues); ``call_op`` does, on every rank.
        """
        future: Future[Any] = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    def call_op(self, name: str) -> Future[Any]:
        """Run the cache operation ``name`` (``cache_ops.CACHE_OPS``) between steps; under
        tensor parallelism every rank runs it at the same point of the same tick."""
        if name not in CACHE_OPS:
            raise ValueError(f"no cache operation {name!r}")
        future: Future[Any] = Future()
        self._inbox.put(("op", (name, future)))
        return future

    def gather(self, name: str) -> Future[list[Any]]:
        """Every rank's answer to the read ``name`` (``cache_ops.RANK_READS``), in rank
        order (alone: a list of one); under tensor parallelism a broadcast, gathered in
        the tick every rank runs it (``ReplicatedScheduler``)."""
        if name not in RANK_READS:
            raise ValueError(f"no rank read {name!r}")
        future: Future[list[Any]] = Future()
        self._inbox.put(("gather", (name, future)))
        return future

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_idle(self) -> bool:
        if self.running or self.waiting:
            return False
        if self.decode_intake is not None and self.decode_intake.num_held:
            return False
        return self.prefill_handoff is None or not self.prefill_handoff.num_sending

    # -------------------------------------------------------------- the loop
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if not self.step():
                    self._wait_for_work()
            except Exception:  # a bug must not hang every client: fail what is in flight
                logger.exception("scheduler step failed; aborting running requests")
                self._fail_all("internal error in the scheduler step")
            self.outputs.flush()  # the step's outputs, to the output thread
            self.cache.publish_events()  # the step's KV events, as one batch
        self._fail_all("server shutting down")
        self.outputs.flush()
        self.outputs.close()  # after delivering every output

    def step(self) -> bool:
        """One scheduling round; False when there was nothing to compute."""
        self._drain_inbox(block_s=0.0)
        self.now = time.monotonic()
        self.cache.poll()
        return self.schedule()

    def schedule(self) -> bool:
        """The tick after its inputs and the cache's progress are applied: admission and
        one forward; False when there was nothing to compute."""
        if self.decode_intake is not None:
            self.decode_intake.advance()
        self._admit()
        if not self.running:
            return False
        if self.governor is not None:
            self.governor.tick()
        began = time.perf_counter()
        prefill_tokens = self._forward_step()
        if prefill_tokens:
            # Work a device runs asynchronously lands in a later step's time: summed
            # over many steps, the seconds still add up.
            self.counters.num_prefill_step_tokens += prefill_tokens
            self.counters.prefill_step_seconds += time.perf_counter() - began
        return True

    def _wait_for_work(self) -> None:
        # Requests held for an L3 prefetch need polling; otherwise sleep until
        # something arrives (the cap keeps background copies acknowledged).
        block = 0.002 if self.waiting else 0.05
        self._drain_inbox(block_s=block)

    def _drain_inbox(self, block_s: float) -> None:
        for item in self.take_inbox(block_s):
            self.handle(*item)

    def take_inbox(self, block_s: float) -> list[tuple[str, Any]]:
        """Everything queued in the inbox, in order, waiting up to ``block_s`` for a first
        item; nothing is applied (``handle`` does that)."""
        items: list[tuple[str, Any]] = []
        try:
            items.append(
                self._inbox.get(timeout=block_s) if block_s > 0 else self._inbox.get_nowait()
            )
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            return items

    def handle(self, kind: str, payload: Any) -> None:
        """Apply one inbox item: ``("add", Req)``, ``("abort", rid)``, ``("call", (fn,
        future))``, ``("op", (name, future or None))`` or ``("gather", (name, future))``."""
        if kind == "add":
            req: Req = payload
            self._by_rid[req.rid] = req
            self.counters.num_requests += 1
            if self.decode_intake is not None and req.request.bootstrap is not None:
                self.decode_intake.add(req)  # its KV comes from a prefill instance
            else:
                self.waiting.append(req)
        elif kind == "abort":
            if self.decode_intake is not None and self.decode_intake.abort(payload):
                return
            target = self._by_rid.get(payload)
            if target is not None:
                self._finish(target, "abort")
        elif kind == "gather":  # alone; under tensor parallelism ReplicatedScheduler's
            name, gather_future = payload
            if gather_future.set_running_or_notify_cancel():
                try:
                    gather_future.set_result([RANK_READS[name](self)])
                except BaseException as error:  # handed to the caller
                    gather_future.set_exception(error)
        elif kind == "op":
            name, op_future = payload
            op = CACHE_OPS[name]
            if op_future is None:  # a follower rank: the outcome is rank 0's to report
                try:
                    op(self)
                except Exception:  # rank 0 fails alike and reports it
                    logger.exception("cache operation %s failed", name)
                return
            if op_future.set_running_or_notify_cancel():
                try:
                    op_future.set_result(op(self))
                except BaseException as error:  # handed to the caller
                    op_future.set_exception(error)
        else:
            fn, future = payload
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:  # handed to the caller
                    future.set_exception(error)

    # ------------------------------------------------------------- admission
    def _admit(self) -> None:
        self.prefetcher.advance(self.waiting)
        # Requests waiting for their KV from a prefill instance take a row when it lands.
        held = len(self.decode_intake.awaiting) if self.decode_intake is not None else 0
        for req in list(self.waiting):
            if len(self.running) + held >= self.config.max_running_requests:
                return
            if not self.prefetcher.settled(req):
                continue
            if not self._start(req):
                return  # no room: keep FIFO order

    def _start(self, req: Req) -> bool:
        """Admit ``req`` if the device pool has room for it; False (and no side effect) if not.

        Room is checked before anything is locked or loaded: a request refused here
        must not load its host prefix (evicting other pages for it) or count as a
        cache hit, as it would again on every step while it waits.
        """
        cache = self.cache
        match_tokens = req.match_tokens()
        prefix = None
        if self.config.enable_prefix_cache:
            prefix = cache.peek(match_tokens, req.request.extra_key)
        # Pages it takes: every page of its context but the cached device prefix (a host
        # prefix takes device pages to load into, as recomputing it would); locking that
        # prefix makes its unlocked pages unevictable. Room for that beyond what admitted
        # requests will still allocate (the rest of their prompts, and a page each to
        # keep decoding).
        need = -(-req.seq_len // self.page_size)
        room = cache.device_pool.allocator.num_free_pages + cache.tree.num_evictable_device_pages
        if prefix is not None:
            need -= prefix.num_device_pages
            room -= prefix.num_unlocked_device_pages
        reserve = sum(self._pages_to_come(r) + 1 for r in self.running)
        if need + reserve > room and self.running:
            return False
        first_admission = req.num_retractions == 0
        if first_admission:
            params = req.request.sampling
            req.stop_ids = frozenset(ending_tokens(params, self.eos_token_ids))
            req.length_limit = min(req.prompt_len + params.max_new_tokens,
                                   self.config.max_context_len)
            if self.prefill_handoff is not None and req.request.bootstrap is not None:
                req.length_limit = self.prefill_handoff.length_limit(req)
        hit = None
        if self.config.enable_prefix_cache:
            hit = cache.acquire(match_tokens, req.request.extra_key, record_hit=first_admission)
        self.waiting.remove(req)
        req.hit = hit
        req.pages = hit.device_pages.copy() if hit is not None else np.empty(0, np.int64)
        req.owned_from = len(req.pages)
        req.num_computed = hit.num_tokens if hit is not None else 0
        req.phase = Phase.PREFILL
        if first_admission:
            # Counted once per request: a retracted one resumes mostly from its own KV.
            if hit is not None:
                storage = min(req.storage_tokens, hit.num_host_tokens)
                req.cached = CachedTokens(
                    device=hit.num_device_tokens, host=hit.num_host_tokens - storage,
                    storage=storage,
                )
            self.counters.num_prompt_tokens += req.prompt_len
            self.counters.num_cached_device_tokens += req.cached.device
            self.counters.num_cached_host_tokens += req.cached.host
            self.counters.num_cached_storage_tokens += req.cached.storage
        self.runner.admit(req)
        self.running.append(req)
        return True

    def _pages_to_come(self, req: Req) -> int:
        return max(0, -(-req.seq_len // self.page_size) - len(req.pages))

    # ------------------------------------------------------------ one step
    def _forward_step(self) -> int:
        """One forward over the running requests; returns the prompt tokens it computed."""
        plan: list[tuple[Req, int]] = []  # (request, new tokens this step)
        budget = self.config.chunked_prefill_size
        retractions = self.counters.num_retractions
        capacity = self.page_size
        decode, waiting = Phase.DECODE, Phase.WAITING
        wants_logits_from = False
        for req in list(self.running):
            phase = req.phase
            if phase is decode:
                # Most steps a decode's page has room for its token: no call, no allocation.
                seq_len = req.seq_len
                if seq_len <= len(req.pages) * capacity or self._ensure_pages(req, seq_len):
                    plan.append((req, 1))
            elif phase is waiting:
                continue  # retracted to make room for a request planned before it
            elif budget > 0:
                n = min(req.seq_len - req.num_computed, budget)
                if self._ensure_pages(req, req.num_computed + n):
                    plan.append((req, n))
                    budget -= n
                    wants_logits_from = wants_logits_from or req.wants_input_logprobs
        if self.counters.num_retractions != retractions:
            # A retraction while planning may have sent an already planned request back.
            plan = [(req, n) for req, n in plan if req.phase in (Phase.PREFILL, Phase.DECODE)]
        if not plan:
            return 0
        prefill_tokens = self.config.chunked_prefill_size - budget
        # A decode's one token is its last, whose logits it samples from; only prompts
        # wanting their logprobs need more rows.
        logits_from = (
            [self._logits_from(req, n) for req, n in plan] if wants_logits_from else None
        )
        wait_layer = self.cache.wait_layer if self.cache.hierarchical else None
        governor = self.governor
        if governor is not None:
            threads = governor.threads_for(sum(n for _, n in plan))
            if threads != self._threads:
                set_thread_count(threads)
                self._threads = threads
        with torch.inference_mode():
            # [sum of (n - logits_from) over the plan, vocab]: each sequence's last row last
            logits = self.runner.forward(plan, logits_from, wait_layer)
        self.counters.num_steps += 1
        done: list[tuple[int, Req]] = []  # (row of its last logits, request)
        if not wants_logits_from:
            # One row per sequence, its last (every decode step): the common case, kept lean.
            for last_row, (req, n) in enumerate(plan):
                computed = req.num_computed + n
                req.num_computed = computed
                if computed == req.prompt_len + len(req.output_ids):
                    done.append((last_row, req))
        else:
            done = self._record_prompt_logprobs(plan, logits, logits_from)
        if not done:
            return prefill_tokens
        if len(done) == len(logits):  # every row, in order (a decode step): no copy
            chosen = logits.float()  # [num_done, vocab], as the model gave them
        else:
            chosen = logits[torch.tensor([row for row, _ in done], device=logits.device)].float()
        reqs = [req for _, req in done]
        source = self._adjusted(chosen, reqs)  # [num_done, vocab]: what tokens come from
        drawn = self._sample(source, reqs) if source is not None else None
        plain = self.logits_observer is None
        now = time.monotonic()
        decode = Phase.DECODE
        append = self._append_token
        for index, req in enumerate(reqs):
            if req.phase is not decode:
                req.phase = decode
                self._cache_prefill(req)
                if req.request.sampling.max_new_tokens == 0:
                    # Prefill only (clients warm the cache this way): the prompt is computed
                    # and cached, no token is produced.
                    self._finish(req, "length")
                    continue
            if req.first_token_at is None:
                req.first_token_at = now
            if drawn is None or source is None:
                self._next_token_alone(req, chosen[index])
                continue
            token = drawn[index]
            if plain and req.plain_greedy and token is not None:
                # The argmax is its token: no row of its own to observe or report.
                try:
                    append(req, token)
                except Exception as error:  # one request's fault must not fail the others
                    self._token_failed(req, error)
                continue
            self._next_token(req, chosen[index], source[index], token)
        return prefill_tokens

    def _record_prompt_logprobs(
        self, plan: list[tuple[Req, int]], logits: torch.Tensor,
        logits_from: list[int] | None,
    ) -> list[tuple[int, Req]]:
        """Advance the plan's requests, keeping the prompt logprobs some asked for; the
        (row of its last logits, request) of each that has its next token to choose."""
        done: list[tuple[int, Req]] = []
        failed: list[tuple[Req, str]] = []
        offset = 0
        for index, (req, n) in enumerate(plan):
            first = logits_from[index] if logits_from is not None else n - 1
            num_rows = n - first
            if req.wants_input_logprobs:
                error = self._record_input_logprobs(req, logits[offset : offset + num_rows],
                                                    req.num_computed + first)
                if error is not None:
                    failed.append((req, error))
            req.num_computed += n
            if req.num_computed == req.seq_len:
                done.append((offset + num_rows - 1, req))
            offset += num_rows
        for req, error in failed:
            self._fail(req, error)
        return [(row, req) for row, req in done if req.phase is not Phase.FINISHED]

    @staticmethod
    def _logits_from(req: Req, n: int) -> int:
        """The first of the ``n`` tokens it computes this step whose logits it needs: the
        last (it samples from it), or earlier ones for the prompt's logprobs."""
        if not req.wants_input_logprobs:
            return n - 1
        # The row at position j gives the logprob of the token at j + 1.
        return min(max(req.logprob_next - 1 - req.num_computed, 0), n - 1)

    def _record_input_logprobs(
        self, req: Req, logits: torch.Tensor, first_position: int
    ) -> str | None:
        """Keep the prompt logprobs that ``logits`` [rows, vocab] (positions from
        ``first_position``) give; the error's text if that failed (for this request alone)."""
        params = req.request.logprobs
        assert params is not None
        if first_position + 1 != req.logprob_next:  # match_tokens() makes this impossible
            return f"prompt logprobs from {req.logprob_next} missed: computed from " \
                f"{first_position + 1}"
        count = min(len(logits), req.prompt_len - req.logprob_next)
        next_ids = req.request.input_ids[req.logprob_next : req.logprob_next + count]
        try:
            req.input_logprobs.extend(position_logprobs(logits[:count], next_ids, params))
        except Exception as error:  # one request's fault must not fail the others
            logger.exception("request %s failed computing its prompt logprobs", req.rid)
            return f"internal error computing prompt logprobs: {type(error).__name__}: {error}"
        req.logprob_next += count
        return None

    def _adjustment(self, req: Req, vocab_size: int) -> RowAdjustment:
        params = req.request.sampling
        if params.has_penalties and req.penalties is None:
            req.penalties = PenaltyState(
                req.request.input_ids if params.repetition_penalty != 1.0 else (),
                vocab_size, self.device,
            )
        banned: tuple[int, ...] = ()
        if len(req.output_ids) < params.min_new_tokens:
            banned = ending_tokens(params, self.eos_token_ids)
        return RowAdjustment(params, req.penalties, banned, req.grammar)

    def _adjusted(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor | None:
        """The rows with penalties and min_new_tokens applied, for the whole batch at once
        (``logits`` itself when none needs it); None when that failed (each request then
        adjusts and samples its own row, so that a faulty one fails alone)."""
        if all(req.plain_greedy for req in reqs):
            return logits  # the common case: no penalty, no mask, no sampling
        try:
            rows = [self._adjustment(req, logits.shape[-1]) for req in reqs]
            if all(row.is_noop for row in rows):
                return logits
            return adjust_logits(logits, rows)
        except Exception:
            logger.exception("adjusting the batch's logits failed; adjusting row by row")
            return None

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int | None] | None:
        """Every request's next token from its row of ``logits`` [rows, vocab], in one batch
        (None for a row with nothing to draw from); None when that failed (each request
        then samples its own row, so that a faulty one fails alone)."""
        try:
            return sample_tokens(
                logits, [req.request.sampling for req in reqs], [req.generator for req in reqs]
            )
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
            return None

    def _next_token_alone(self, req: Req, logits: torch.Tensor) -> None:
        """Adjust and sample the one row ``logits`` [vocab] of ``req``, then take its token:
        the way back when doing that for the batch failed. (A seeded request drew its
        uniform in the failed batch already, so its draw here is the next one.)"""
        try:
            row = self._adjustment(req, logits.shape[-1])
            sampled_from = logits if row.is_noop else adjust_logits(logits[None], [row])[0]
            token = sample_tokens(sampled_from[None], [req.request.sampling], [req.generator])[0]
        except Exception as error:  # one request's fault must not fail the others
            self._token_failed(req, error)
            return
        self._next_token(req, logits, sampled_from, token)

    def _next_token(
        self, req: Req, logits: torch.Tensor, sampled_from: torch.Tensor, token: int | None
    ) -> None:
        """Append, detokenize, stop and stream one request's ``token``.

        ``logits`` [vocab] are the model's (its logprobs come from them), ``sampled_from``
        the same with the request's penalties and masks applied, ``token`` what was drawn
        from them: None when they hold a NaN or an infinity, or are all -inf.

        All of it concerns this request alone, so a failure here (a detokenizer error on
        its tokens, logits with nothing to sample) fails this request alone: its KV is
        valid and goes to the tree as on any finish, and the batch goes on.
        """
        if token is None:
            logger.error("request %s: its logits hold NaN or infinity, or are all -inf",
                         req.rid)
            self._fail(req, "cannot produce the next token: the logits to sample it from hold "
                       "NaN or infinity, or are all -inf")
            return
        try:
            if self.logits_observer is not None:
                self.logits_observer(req.rid, sampled_from.cpu())
            if req.request.logprobs is not None:
                req.output_logprobs.extend(
                    position_logprobs(logits[None], [token], req.request.logprobs)
                )
            self._append_token(req, token)
        except Exception as error:  # one request's fault must not fail the others
            self._token_failed(req, error)

    def _token_failed(self, req: Req, error: Exception) -> None:
        """Producing ``req``'s next token raised: fail it alone."""
        logger.exception("request %s failed while producing its next token", req.rid)
        self._fail(
            req, f"internal error producing the next token: {type(error).__name__}: {error}"
        )

    def _fail(self, req: Req, error: str) -> None:
        if req.phase is not Phase.FINISHED:
            self._finish(req, "abort", flush_text=False, error=error)

    def _ensure_pages(self, req: Req, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` tokens of context; retract others (or itself) if short."""
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
                        self._retract(req)
                        return False
                    # Alone and still short. Every validated request fits the empty pool,
                    # so what holds the pages is in flight: copies to L2, or L3 backups
                    # pinning the host pages that write_back needs to evict into. A coming
                    # poll releases them: wait, requeued. Only a shortage that never ends
                    # (a leak) fails the request.
                    now = self.now
                    if req.short_since is None:
                        req.short_since = now
                    if now - req.short_since < SHORT_OF_PAGES_ABORT_S:
                        self._retract(req)
                        return False
                    self._finish(req, "abort", error="the device KV pool stayed too full for it")
                    return False
                self._retract(victim)
        return True

    def _retraction_victim(self, exclude: Req) -> Req | None:
        candidates = [r for r in self.running if r is not exclude]
        return max(candidates, key=lambda r: r.arrived) if candidates else None

    def _retract(self, req: Req) -> None:
        """Out of device pages: give the request's KV to the tree and requeue it."""
        self._release(req, keep_kv=True)
        req.phase = Phase.WAITING
        req.num_retractions += 1
        self.counters.num_retractions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # -------------------------------------------------------- cache handover
    def _cache_prefill(self, req: Req) -> None:
        """Write-through after prefill: the prompt's whole pages go to the tree now."""
        if not self.config.enable_prefix_cache or req.hit is None:
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
        if keep_kv and self.config.enable_prefix_cache and req.hit is not None:
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

    # ----------------------------------------------------------- outputs
    def _append_token(self, req: Req, token: int) -> None:
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
            elif self._cut_at_stop(req):
                reason, stop_string = "stop", True
        if reason is None and req.prompt_len + num_out >= req.length_limit:
            reason = "length"
        if reason is not None:
            self._finish(req, reason, flush_text=not stop_string)
        else:
            self.outputs.add(req, final=False)

    @staticmethod
    def _cut_at_stop(req: Req) -> bool:
        """Trim the text at the first stop string; True when there was one."""
        cut = _find_stop(req.text, req.request.sampling.stop, req.scanned_chars)
        if cut is None:
            req.scanned_chars = len(req.text)
            return False
        req.text = req.text[:cut]
        return True

    def _finish(
        self, req: Req, reason: str, error: str | None = None, flush_text: bool = True
    ) -> None:
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
            if self._cut_at_stop(req):
                reason = "stop"
        self.prefetcher.cancel(req)
        phase = req.phase
        if phase is not Phase.WAITING:
            # Keep the KV of a request that finished (or was aborted) mid-way: it
            # is valid, and the next turn of the conversation will want it.
            self._release(req, keep_kv=True)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
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

    def _count_abort(self, phase: Phase) -> None:
        counters = self.counters
        if phase is Phase.WAITING:
            counters.num_aborted_waiting += 1
        elif phase is Phase.PREFILL:
            counters.num_aborted_prefill += 1
        else:
            counters.num_aborted_decode += 1

    def _fail_all(self, message: str) -> None:
        if self.decode_intake is not None:
            self.decode_intake.fail_all(message)
        if self.prefill_handoff is not None:
            self.prefill_handoff.fail_all(message)
        for req in [*self.running, *self.waiting]:
            try:
                self._finish(req, "abort", error=message)
            except Exception:  # keep failing the others
                logger.exception("could not finish request %s cleanly", req.rid)


def _find_stop(text: str, stops: tuple[str, ...], scanned: int) -> int | None:
    """Index where the earliest stop string starts in ``text``, searching only where one
    could end past ``text[:scanned]`` (searched before, with none found)."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, scanned - len(stop) + 1))
        if index >= 0 and (best is None or index < best):
            best = index
    return best
