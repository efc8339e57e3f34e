"""The scheduler: continuous batching over the hierarchical cache, on one thread.

It is admission, batch planning and the step loop; a request's state after
admission changes in ``lifecycle.py`` (tokens, stops, finish, retraction) and a
step's logits become tokens in ``postprocess.py``. The disaggregation hooks
(``pd_prefill.py``, ``pd_decode.py``) and the cache operations (``cache_ops.py``)
see the narrow interfaces they declare, not the scheduler.

Each step:
1. take new requests, aborts and control calls from the inbox;
2. ``cache.poll()``: acknowledge landed copies, advance L3 prefetches/backups;
3. start the L3 prefetch of every request that arrived (within a host-page
   budget), so that queueing hides it; admit waiting requests (FIFO) whose
   prefetch the policy lets start, while the device pool can hold their
   context: only then match and lock the cached prefix (host hits start
   loading layer by layer) and count the hit, once per request; the prefixes
   of the requests still waiting are touched (most recently used, the head of
   the queue last) on arrival and after admissions, so that the prefills ahead
   of them evict other pages first;
4. one forward over every decoding request (one token each) plus prompt
   chunks of prefilling requests (at most ``chunked_prefill_size`` tokens; beside
   decode rows, with ``--max-decode-delay-ms``/``-factor``, what ``step_budget.py``
   allows; past ``prompt_share_tokens`` of them, no further prompt joins the step);
   a failure of the forward fails the requests in flight;
5. sample every row at once (one host sync), then stream and finish each
   request on its own (a failure there fails that request alone): a finished
   request gives its KV to the radix tree;
6. the KV events the step's cache changes produced go out as one batch.

The thread does no blocking I/O: L2 copies run on the cache controller's
streams/threads and L3 on the storage controller's threads. When the device
pool runs dry for decodes, the newest request is retracted (its KV goes to the
tree, so it resumes mostly from cache).

Aborts in the inbox are applied (step 1) before anything is admitted (step 3): an
aborted queued request leaves ``waiting`` without being prefilled, a running one
leaves the batch with its pages released.

Failures stay with their request: NaN or infinite logits (or all -inf), a failed
detokenizer, a grammar refusing the token fail that request alone, and a batched
adjusting or sampling that raises falls back to one row at a time
(``postprocess.py``). Only an exception out of the step itself, such as a failed
batched forward, fails the requests in flight (``fail_all``), and the loop goes on;
under tensor parallelism any exception in a tick ends the rank instead
(``replication.py``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.engine.api import CachedTokens
from hicache.engine.cache_ops import CACHE_OPS, RANK_READS
from hicache.engine.config import SchedulerLimits
from hicache.engine.cost_model import CostModel
from hicache.engine.counters import EngineCounters
from hicache.engine.lifecycle import RequestLifecycle
from hicache.engine.model_runner import ModelRunner
from hicache.engine.output_thread import DiscardedOutputs, OutputThread
from hicache.engine.pd_decode import DecodeIntake
from hicache.engine.postprocess import PostProcessor
from hicache.engine.prefetcher import Prefetcher, read_wait_s
from hicache.engine.request import Phase, Req
from hicache.engine.reuse import ReuseAdvisor
from hicache.engine.step_budget import prefill_budget
from hicache.engine.thread_governor import ThreadGovernor
from hicache.engine.threads import set_thread_count
from hicache.estimators import attention_pairs
from hicache.model.model import CausalLM

logger = logging.getLogger(__name__)

# Waiting requests whose cached prefixes the scheduler keeps fresh (``_keep_waiting_prefixes``):
# the head of the queue, admitted soonest; a bound on the tree walks per admission round.
KEEP_WAITING_PREFIXES = 32


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        cache: HierarchicalCache,
        limits: SchedulerLimits,
        eos_token_ids: Iterable[int],
        output_thread: bool = True,
        deliver_outputs: bool = True,
    ) -> None:
        """``deliver_outputs`` False: outputs are dropped (a tensor-parallel follower rank,
        whose requests rank 0 streams)."""
        self.model = model
        self.cache = cache
        self.limits = limits
        eos = frozenset(eos_token_ids)
        self.page_size = cache.page_size
        self.counters = EngineCounters()
        # Live costs of this instance, fed by every step (``cost_model.py``).
        self.cost_model = CostModel(
            limits.chunked_prefill_size,
            skip_warmup=cache.device_pool.device.type == "cuda",
        )
        # The last forward's shape: its attention pairs and decode rows (forward_step).
        self._step_pairs = 0
        self._step_decode_rows = 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.prefetcher = Prefetcher(cache, enabled=limits.enable_prefix_cache)
        # Outputs are recorded in it per step and flushed to its thread after each step
        # (``run``), which detokenizes and streams them; a failed detokenizer aborts.
        self.outputs = (
            OutputThread(on_failure=self.abort, threaded=output_thread) if deliver_outputs
            else DiscardedOutputs()
        )
        self.runner = ModelRunner(
            model, cache.device_pool, limits.max_running_requests, limits.max_context_len
        )
        # The queues and every change of an admitted request's state; then its tokens.
        self.lifecycle = RequestLifecycle(
            cache, self.runner, limits, eos, self.outputs, self.prefetcher, self.counters
        )
        self.postprocess = PostProcessor(self.lifecycle, eos, cache.device_pool.device)
        # The tick's clock (time.monotonic()'s reading when the tick began): every
        # time-based decision reads it, so that ranks fed rank 0's reading decide alike.
        self.now = time.monotonic()
        # Per request with a host or L3 hit: how much to load, how much to compute again.
        self.reuse = ReuseAdvisor(cache, self.cost_model, self._clock)
        self.prefetcher.worth_waiting = self._worth_waiting
        # Requests arrived or were admitted since the waiting ones' prefixes were touched.
        self._queue_changed = False
        # Picks torch's intra-op threads between steps (None: the count stays as set).
        self.governor: ThreadGovernor | None = None
        self._threads = 0  # the count last set for a step (0: none yet)
        # A decode instance's (engine/disaggregation.py sets it): requests whose KV comes
        # from a prefill instance. (A prefill instance's hook is the lifecycle's.)
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

    def call_op(self, name: str, *args: Any) -> Future[Any]:
        """Run the cache operation ``name`` (``cache_ops.CACHE_OPS``) with ``args`` between
        steps; under tensor parallelism every rank runs it at the same point of the same
        tick (the arguments travel with the name, so they must pickle)."""
        if name not in CACHE_OPS:
            raise ValueError(f"no cache operation {name!r}")
        future: Future[Any] = Future()
        self._inbox.put(("op", ((name, args), future)))
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

    # ------------------------------------------------ read on the scheduler thread
    @property
    def num_running(self) -> int:
        return len(self.lifecycle.running)

    @property
    def num_waiting(self) -> int:
        return len(self.lifecycle.waiting)

    def running_requests(self) -> tuple[Req, ...]:
        """The running requests, in admission order."""
        return tuple(self.lifecycle.running)

    def waiting_requests(self) -> tuple[Req, ...]:
        """The waiting requests, in the order they are admitted."""
        return tuple(self.lifecycle.waiting)

    def is_idle(self) -> bool:
        if self.lifecycle.running or self.lifecycle.waiting:
            return False
        if self.cache.l3_warms:  # their prefetches hold host pages a flush would free
            return False
        if self.decode_intake is not None and self.decode_intake.num_held:
            return False
        handoff = self.lifecycle.prefill_handoff
        return handoff is None or not handoff.num_sending

    # -------------------------------------------------------------- the loop
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if not self.step():
                    self._wait_for_work()
            except Exception:  # a bug must not hang every client: fail what is in flight
                logger.exception("scheduler step failed; aborting running requests")
                self.fail_all("internal error in the scheduler step")
            self.outputs.flush()  # the step's outputs, to the output thread
            self.cache.publish_events()  # the step's KV events, as one batch
        self.fail_all("server shutting down")
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
        if not self.lifecycle.running:
            return False
        if self.governor is not None:
            self.governor.tick()
        began = time.perf_counter()
        prefill_tokens = self.forward_step()
        # Work a device runs asynchronously lands in a later step's time: summed over
        # many steps, the seconds still add up.
        seconds = time.perf_counter() - began
        self.cost_model.steps.observe(prefill_tokens, self._step_decode_rows, seconds)
        if prefill_tokens:
            self.counters.num_prefill_step_tokens += prefill_tokens
            self.counters.prefill_step_seconds += seconds
            self.cost_model.observe_step(
                prefill_tokens, self._step_pairs, self._step_decode_rows, seconds
            )
        controller = self.cache.controller
        if controller is not None:
            self.cost_model.observe_loads(controller.take_load_samples())
        return True

    def fail_all(self, message: str) -> None:
        """Abort every request in flight with ``message``, held ones included."""
        if self.decode_intake is not None:
            self.decode_intake.fail_all(message)
        if self.lifecycle.prefill_handoff is not None:
            self.lifecycle.prefill_handoff.fail_all(message)
        self.lifecycle.finish_all(message)

    def _wait_for_work(self) -> None:
        # Requests held for an L3 prefetch (and warms) need polling; otherwise sleep until
        # something arrives (the cap keeps background copies acknowledged).
        block = 0.002 if self.lifecycle.waiting or self.cache.l3_warms else 0.05
        if block > 0.002 and self.cache.fault_in_host_memory():
            block = 0.0  # a piece of the host pool faulted in: look for work, then go on
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
        future))``, ``("op", ((name, args), future or None))`` or ``("gather", (name, future))``."""
        lifecycle = self.lifecycle
        if kind == "add":
            req: Req = payload
            lifecycle.arrive(req)
            if self.decode_intake is not None and req.request.bootstrap is not None:
                self.decode_intake.add(req)  # its KV comes from a prefill instance
            else:
                lifecycle.waiting.append(req)
                self._queue_changed = True
        elif kind == "abort":
            if self.decode_intake is not None and self.decode_intake.abort(payload):
                return
            target = lifecycle.find(payload)
            if target is not None:
                lifecycle.finish(target, "abort")
        elif kind == "gather":  # alone; under tensor parallelism ReplicatedScheduler's
            name, gather_future = payload
            _resolve(gather_future, lambda: [RANK_READS[name](self)])
        elif kind == "op":
            (name, args), op_future = payload
            op = CACHE_OPS[name]
            if op_future is None:  # a follower rank: the outcome is rank 0's to report
                try:
                    op(self, *args)
                except Exception:  # rank 0 fails alike and reports it
                    logger.exception("cache operation %s failed", name)
                return
            _resolve(op_future, lambda: op(self, *args))
        else:
            fn, future = payload
            _resolve(future, fn)

    # ------------------------------------------------------------- admission
    def _admit(self) -> None:
        waiting = self.lifecycle.waiting
        self.prefetcher.advance(waiting, self._read_wait_s)
        # Requests waiting for their KV from a prefill instance take a row when it lands.
        held = len(self.decode_intake.awaiting) if self.decode_intake is not None else 0
        try:
            for req in list(waiting):
                if len(self.lifecycle.running) + held >= self.limits.max_running_requests:
                    return
                if not self.prefetcher.settled(req):
                    continue
                if not self._start(req):
                    return  # no room: keep FIFO order
                self._queue_changed = True
        finally:
            if self._queue_changed:
                self._queue_changed = False
                self._keep_waiting_prefixes()

    def _keep_waiting_prefixes(self) -> None:
        """Touch the cached prefixes of the first ``KEEP_WAITING_PREFIXES`` waiting
        requests, from the last of them to the head, so that eviction takes pages no
        waiting request needs first and, of theirs, those needed latest.

        Done once per admission round in which requests arrived or were admitted (whose
        prefill then writes new pages, evicting least recently used ones): a multi-turn
        conversation's next turn can wait in the queue for several prefills, and under
        plain LRU the pages of its earlier turns, last used when that turn ended, went
        first. Only
        the inbox and admissions trigger it, never the clock, so tensor-parallel ranks
        touch alike."""
        if not self.limits.enable_prefix_cache:
            return
        first = list(itertools.islice(self.lifecycle.waiting, KEEP_WAITING_PREFIXES))
        for req in reversed(first):
            self.cache.touch(req.match_key(), req.request.extra_key)

    def _start(self, req: Req) -> bool:
        """Admit ``req`` if the device pool has room for it; False (and no side effect) if not.

        Room is checked before anything is locked or loaded: a request refused here
        must not load its host prefix (evicting other pages for it) or count as a
        cache hit, as it would again on every step while it waits.
        """
        cache = self.cache
        match_tokens = req.match_key()
        prefix = None
        if self.limits.enable_prefix_cache:
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
        lifecycle = self.lifecycle
        reserve = sum(self._pages_to_come(r) + 1 for r in lifecycle.running)
        if need + reserve > room and lifecycle.running:
            return False
        first_admission = req.num_retractions == 0
        if first_admission:
            lifecycle.set_stop_conditions(req)
            handoff = lifecycle.prefill_handoff
            if handoff is not None and req.request.bootstrap is not None:
                req.length_limit = handoff.length_limit(req)
        hit = None
        if self.limits.enable_prefix_cache:
            # Load the host hit only up to where computing the rest is faster (reuse.py).
            rows = len(lifecycle.running)
            limit, plan, costs = self.reuse.acquire_limit(req, prefix, rows)
            hit = cache.acquire(match_tokens, req.request.extra_key,
                                record_hit=first_admission, max_tokens=limit)
            self.reuse.admitted(req, hit.num_device_tokens, hit.num_host_tokens, plan, costs,
                                rows)
        lifecycle.waiting.remove(req)
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
        lifecycle.running.append(req)
        return True

    def _clock(self) -> float:
        return self.now

    def _worth_waiting(self, req: Req) -> bool:
        return self.reuse.should_wait(req, len(self.lifecycle.running))

    def _pages_to_come(self, req: Req) -> int:
        return max(0, -(-req.seq_len // self.page_size) - len(req.pages))

    def _running_shape(self) -> tuple[int, int, int]:
        """The running requests' decode rows, prompt tokens still to compute, and how many
        are prefilling (retracted ones, back in the queue, are neither)."""
        rows = prompt = prefilling = 0
        decode, prefill = Phase.DECODE, Phase.PREFILL
        for req in self.lifecycle.running:
            if req.phase is decode:
                rows += 1
            elif req.phase is prefill:
                prompt += req.seq_len - req.num_computed
                prefilling += 1
        return rows, prompt, prefilling

    def _read_wait_s(self) -> float:
        """What this admission round may wait for held requests' L3 reads: a share of the
        next step's predicted time (``prefetcher.read_wait_s``)."""
        rows, prompt, prefilling = self._running_shape()
        prompt = min(prompt, self.limits.chunked_prefill_size)
        return read_wait_s(self.reuse.costs(), prompt, rows, rows + prefilling)

    def _prefill_budget(self, chunk: int) -> int:
        """This step's prompt tokens beside its decode rows (``step_budget.py``), priced
        with the costs every rank shares (rank 0's under tensor parallelism)."""
        rows, _, prefilling = self._running_shape()
        if rows == 0 or not prefilling:
            return chunk
        limits, costs = self.limits, self.reuse.costs().step
        if costs is None or costs.wants_decode_sample():
            return 0  # a decode-only step, timed: what the budget prices with
        return prefill_budget(costs, chunk, rows,
                              limits.max_decode_delay_s, limits.max_decode_delay_factor)

    # ------------------------------------------------------------ one step
    def forward_step(self) -> int:
        """One forward over the running requests, then their tokens (``postprocess``);
        returns the prompt tokens it computed."""
        plan: list[tuple[Req, int]] = []  # (request, new tokens this step)
        budget = self.limits.chunked_prefill_size
        limits = self.limits
        if limits.max_decode_delay_s is not None or limits.max_decode_delay_factor is not None:
            budget = self._prefill_budget(budget)
        full_budget = budget
        share = limits.prompt_share_tokens
        retractions = self.counters.num_retractions
        capacity = self.page_size
        decode, waiting = Phase.DECODE, Phase.WAITING
        wants_logits_from = False
        ensure_pages, now = self.lifecycle.ensure_pages, self.now
        pairs = rows = 0  # the step's shape, for the cost model
        for req in list(self.lifecycle.running):
            phase = req.phase
            if phase is decode:
                # Most steps a decode's page has room for its token: no call, no allocation.
                seq_len = req.seq_len
                if seq_len <= len(req.pages) * capacity or ensure_pages(req, seq_len, now):
                    plan.append((req, 1))
                    rows += 1
            elif phase is waiting:
                continue  # retracted to make room for a request planned before it
            elif budget > 0 and (share is None or full_budget - budget < share):
                n = min(req.seq_len - req.num_computed, budget)
                if share is not None and req.wants_input_logprobs:
                    # Its rows keep their logits: as many as the memory reserve assumes.
                    n = min(n, share - (full_budget - budget))
                if ensure_pages(req, req.num_computed + n, now):
                    plan.append((req, n))
                    budget -= n
                    pairs += attention_pairs(n, req.num_computed)
                    wants_logits_from = wants_logits_from or req.wants_input_logprobs
        prefill_tokens = full_budget - budget
        if self.counters.num_retractions != retractions:
            # A retraction while planning may have sent an already planned request back.
            plan = [(req, n) for req, n in plan if req.phase in (Phase.PREFILL, Phase.DECODE)]
            pairs = sum(attention_pairs(n, req.num_computed) for req, n in plan
                        if req.phase is Phase.PREFILL)
            rows = sum(1 for req, _ in plan if req.phase is decode)
        self._step_pairs, self._step_decode_rows = pairs, rows
        if not plan:
            return 0
        postprocess = self.postprocess
        # A decode's one token is its last, whose logits it samples from; only prompts
        # wanting their logprobs need more rows.
        logits_from = (
            [postprocess.logits_from(req, n) for req, n in plan] if wants_logits_from else None
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
            done = postprocess.record_prompt_logprobs(plan, logits, logits_from)
        if not done:
            return prefill_tokens
        postprocess.take_tokens(logits, done)
        return prefill_tokens


def _resolve(future: Future[Any], fn: Callable[[], Any]) -> None:
    """Run ``fn`` for ``future`` unless its caller cancelled it; the result or the error
    goes to the caller."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as error:  # handed to the caller
            future.set_exception(error)
