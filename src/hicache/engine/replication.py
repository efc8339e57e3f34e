"""Replicated schedulers under tensor parallelism: every rank runs the same Scheduler over
its own cache (its KV shard), fed the same inputs, so that every rank makes the same
decisions and issues the same model collectives; rank 0 leads.

One tick, on every rank, in this order (``ReplicatedScheduler.tick``):

1. Inputs: rank 0 drains its inbox (new requests, aborts, cache operations) and
   broadcasts them with its clock reading as one ``Tick``; every rank, rank 0 included,
   then applies the broadcast events in their order. A sampled request without a seed
   gets one drawn by rank 0, so every rank draws the same tokens; a new request's
   arrival time is rank 0's. Control calls that only read (``Scheduler.call``) run on
   rank 0 alone; the ones that change the cache are named operations
   (``cache_ops``), run by every rank. A read of every rank's own state (``RANK_READS``,
   as its L3 counters) is broadcast too: every rank answers it and gathers the answers
   to rank 0 (one ``gather_object``, issued by every rank since the tick says so).
2. Agreement: ONE fixed-shape collective, an int64 tensor of ``Progress.NUM_FIELDS``
   reduced with MIN, issued unconditionally by every rank every tick (never inside a
   branch on rank-local state). It carries each rank's local progress (the number of
   its oldest L2 writes that have landed, in submission order, and its L3 progress:
   the backups finished in submission order and, per prefetch slot, whether the
   lookup answered, the pages found, the pages landed, whether the read is complete
   and whether the deadline passed, see ``cache.l3_agreement``); every rank then
   applies only the agreed minimum, so a rank whose copies lag or whose L3 finds or
   reads less holds the others back rather than letting their trees diverge.
3. The tick itself (``Scheduler.schedule``): admission and one forward, whose time-based
   decisions read the tick's clock (``Scheduler.now``), rank 0's reading, and whose
   load-or-recompute choices are priced with rank 0's live costs (``Tick.costs``).

Rank 0 streams outputs; the followers drop theirs. Rank 0 stops the group with a
tick whose ``stop`` is set. A failed collective (a peer died: gloo raises when its
connection closes) or any exception in a tick is fatal to the rank, since its state
may no longer match the others': the requests in flight fail with the cause (not as a
shutdown), the loop raises and the process exits non-zero, which the server's
``EngineClient`` sees. Nothing waits on a peer without a timeout.

L3 prefetch deadlines read the tick clock (``Scheduler.now``) under tensor parallelism.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.cache.l3_agreement import L3Progress
from hicache.distributed.group import TPGroup
from hicache.engine.api import GenerateRequest
from hicache.engine.cache_ops import RANK_READS
from hicache.engine.request import Req
from hicache.engine.reuse_plan import CostSnapshot
from hicache.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# How long rank 0 waits for work when there is none, per tick (the followers wait in
# the broadcast meanwhile). Requests waiting for room poll more often.
IDLE_WAIT_S = 0.05
WAITING_POLL_S = 0.002


@dataclass(frozen=True)
class AddRequest:
    """A new request as every rank builds it."""

    request: GenerateRequest
    rid: str
    seed: int | None  # its generator's seed (None: greedy, no generator)
    arrived: float  # rank 0's time.monotonic() at its arrival


# An event of a tick: ("add", AddRequest), ("abort", rid), ("op", (cache operation name,
# its arguments)) or ("gather", rank read name).
Event = tuple[str, Any]


@dataclass(frozen=True)
class Tick:
    """What rank 0 broadcasts each tick."""

    now: float  # rank 0's time.monotonic() for the tick
    events: tuple[Event, ...]
    stop: bool = False
    # Rank 0's live costs: every rank prices its load-or-recompute choices with them.
    costs: CostSnapshot | None = None


@dataclass(frozen=True)
class Progress:
    """A rank's local progress, agreed field by field with MIN over the ranks."""

    num_landed_writes: int
    l3: L3Progress = field(default_factory=L3Progress)

    NUM_FIELDS = 1 + L3Progress.NUM_FIELDS

    def to_tensor(self) -> torch.Tensor:
        values = [self.num_landed_writes, *self.l3.values()]
        return torch.tensor(values, dtype=torch.int64)  # [NUM_FIELDS]

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, num_slots: int = 0) -> Progress:
        """The inverse of ``to_tensor``, keeping ``num_slots`` prefetch slots."""
        values = tensor.tolist()
        return cls(
            num_landed_writes=int(values[0]), l3=L3Progress.from_values(values[1:], num_slots)
        )


def agree(tp: TPGroup, local: Progress) -> Progress:
    """The minimum of every rank's ``local`` progress. Every rank must call it every tick."""
    agreed = tp.all_reduce_min(local.to_tensor())
    return Progress.from_tensor(agreed, num_slots=len(local.l3.slots))


class ReplicatedScheduler:
    """Drives one rank's Scheduler in lockstep with the other ranks' (see the module doc).

    ``make_req`` builds a follower's Req from a broadcast AddRequest (rank 0 uses the
    Req its engine queued). ``observe`` may replace how local progress is read (tests
    inject a lagging rank through it).
    """

    def __init__(
        self, scheduler: Scheduler, tp: TPGroup, make_req: Callable[[AddRequest], Req],
    ) -> None:
        self.scheduler = scheduler
        self.tp = tp
        self.make_req = make_req
        self.leader = tp.rank == 0
        self.observe: Callable[[], Progress] = lambda: Progress(
            scheduler.cache.observe_progress(), scheduler.cache.observe_l3_progress()
        )
        # L3 decisions wait for the agreement, and its deadlines read the tick clock.
        scheduler.cache.replicated = True
        scheduler.cache.clock = lambda: scheduler.now
        # The agreed progress of every tick, in order, when ``record`` (tests compare ranks).
        self.record = False
        self.agreed: list[Progress] = []
        self.num_ticks = 0

    def run(self, stop: threading.Event) -> None:
        """Tick until rank 0's ``stop`` is set (followers: until rank 0 says so).

        A failure raises (after failing the requests in flight): the caller must end
        the rank, whose peers then fail too.
        """
        scheduler = self.scheduler
        worked = True
        reason = "server shutting down"
        try:
            while True:
                block = 0.0 if worked else (
                    WAITING_POLL_S if scheduler.num_waiting else IDLE_WAIT_S
                )
                stopping, worked = self.tick(stop, block)
                scheduler.outputs.flush()
                scheduler.cache.publish_events()
                if stopping:
                    break
        except BaseException as error:
            # The requests in flight end with the cause, not as if the server stopped.
            reason = (f"tensor-parallel rank {self.tp.rank} failed ({type(error).__name__}: "
                      f"{error}): the engine cannot go on")
            raise
        finally:
            scheduler.fail_all(reason)
            scheduler.outputs.flush()
            scheduler.outputs.close()

    def tick(self, stop: threading.Event | None = None, block_s: float = 0.0) -> tuple[bool, bool]:
        """One tick on this rank; (whether the group stops, whether it computed)."""
        scheduler = self.scheduler
        local: list[tuple[str, Any]] = []
        if self.leader:
            items = scheduler.take_inbox(block_s)
            tick = self._lead(items, local, stop is not None and stop.is_set())
            self.tp.broadcast_object(tick)
        else:
            received: Any = self.tp.broadcast_object(None)
            if not isinstance(received, Tick):
                raise RuntimeError(f"rank 0 broadcast {type(received).__name__}, not a Tick")
            tick = received
            local = [self._follow(event) for event in tick.events]
        for kind, payload in local:
            if kind == "gather":
                self._gather(*payload)
            else:
                scheduler.handle(kind, payload)
        scheduler.now = tick.now
        scheduler.reuse.shared_costs = tick.costs
        agreed = agree(self.tp, self.observe())
        scheduler.cache.apply_progress(agreed.num_landed_writes)
        scheduler.cache.apply_l3_progress(agreed.l3)
        self.num_ticks += 1
        if self.record:
            self.agreed.append(agreed)
        if tick.stop:
            return True, False
        return False, scheduler.schedule()

    def _lead(self, items: list[tuple[str, Any]], local: list[tuple[str, Any]], stop: bool) -> Tick:
        """Rank 0: the tick to broadcast; ``local`` gets what rank 0 applies, in order.

        Read-only calls run on rank 0 alone (not broadcast).
        """
        events: list[Event] = []
        for kind, payload in items:
            if kind == "add":
                req: Req = payload
                seed = None
                if req.generator is not None:
                    params = req.request.sampling
                    seed = params.seed if params.seed is not None else secrets.randbits(63)
                    req.generator.manual_seed(seed)
                events.append(("add", AddRequest(req.request, req.rid, seed, req.arrived)))
            elif kind == "abort":
                events.append(("abort", payload))
            elif kind in ("op", "gather"):
                events.append((kind, payload[0]))
            local.append((kind, payload))
        costs = self.scheduler.reuse.local_costs()
        return Tick(now=time.monotonic(), events=tuple(events), stop=stop, costs=costs)

    def _follow(self, event: Event) -> tuple[str, Any]:
        """A follower: the inbox item an event stands for."""
        kind, payload = event
        if kind == "add":
            return "add", self.make_req(payload)
        if kind in ("op", "gather"):
            return kind, (payload, None)
        return kind, payload

    def _gather(self, name: str, future: Future[list[Any]] | None) -> None:
        """Every rank: answer the read ``name`` and gather the answers to rank 0, which
        resolves ``future`` (None on the followers). A read that raises answers None: the
        gather must happen on every rank whatever the read did."""
        answer: Any = None
        failure: Exception | None = None
        try:
            answer = RANK_READS[name](self.scheduler)
        except Exception as error:
            logger.exception("rank read %s failed on rank %d", name, self.tp.rank)
            failure = error
        answers = self.tp.gather_object(answer)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(answers or [])
