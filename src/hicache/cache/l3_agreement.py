"""What the ranks of a tensor-parallel group agree on about L3 each tick.

Every rank runs its own L3 tier against its own store (its KV shard), so a lookup
may find fewer pages on one rank, a read may land fewer, and backups finish at
different times. Nothing rank-local may change the tree: each rank reports its
``L3Progress`` and applies only the field-wise minimum over the ranks, so the
rank whose store lags or fails makes the agreed prefix shorter for all.

Prefetches are agreed through ``NUM_SLOTS`` fixed slots, in the order the
prefetches started (the same on every rank, since they start from agreed state);
a prefetch past the slots waits for one. Backups are agreed as the number of the
oldest ones (in submission order) that have finished.

``L3Agreement`` is a tier's bookkeeping for it: which prefetches hold a slot, which
backups await agreement, what this rank reports (``observe``) and what it does with the
agreed values (``apply``). The tier (``cache/l3.py``) keeps the single-rank logic and
defers to it where a decision would otherwise rest on rank-local values:

- a lookup's answer: the read starts from the agreed number of pages found (here);
- when a prefetch is complete or past its deadline, and how many pages it keeps:
  from the agreed values (``complete``, ``past_deadline``, ``num_landed_pages``);
- a settled prefetch's unkept host pages, including those of a stalled read on this
  rank: freed when every rank reports its I/O for it returned (slot ``complete``
  while draining), so free host pages, and with them evictions, stay alike;
- a finished backup: acknowledged (its node unprotected) once every rank finished it,
  and on a rank where its ``set`` stalled, once that call returned: until then the
  stalled rank keeps the node protected, and so must every rank, or the node would be
  evictable on some ranks only;
- a flush while backups await agreement: the tree forgets their nodes,
  but every rank keeps their host pages reserved (``orphan_backups``) and frees them
  when the backup is agreed finished, the same tick everywhere, rather than when this
  rank's stalled ``set`` returns;
- a detach: the tier leaves the cache, but its slots keep draining and its backups keep
  awaiting agreement (``busy``), and the cache goes on agreeing on them each tick.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.cache.l3 import PrefetchHandle, StorageTier
    from hicache.memory.allocator import PageIds
    from hicache.storage.controller import BackupOp

# Prefetches agreed at once; fixed so that the per-tick collective has a fixed shape.
NUM_SLOTS = 16


@dataclass(frozen=True)
class SlotProgress:
    """One prefetch as a rank sees it (flags are 0/1 so that MIN is a logical AND)."""

    queried: int = 0  # the lookup has answered
    num_found_pages: int = 0  # pages L3 holds past the local match (0 until queried)
    num_landed_pages: int = 0  # leading pages verified on the host
    complete: int = 0  # nothing more will land: read done, or nothing to read
    past_deadline: int = 0  # the tick clock has reached the prefetch's deadline

    NUM_FIELDS = 5

    def values(self) -> list[int]:
        return [
            self.queried, self.num_found_pages, self.num_landed_pages, self.complete,
            self.past_deadline,
        ]


EMPTY_SLOT = SlotProgress()


@dataclass(frozen=True)
class L3Progress:
    """A rank's L3 progress: its backups acknowledged in order, and its prefetch slots."""

    num_done_backups: int = 0
    slots: tuple[SlotProgress, ...] = ()

    NUM_FIELDS = 1 + NUM_SLOTS * SlotProgress.NUM_FIELDS

    def values(self) -> list[int]:
        """Fixed length ``NUM_FIELDS``: unused slots read as empty (every rank has the same
        slots in use, so MIN never mixes an empty slot with a used one)."""
        assert len(self.slots) <= NUM_SLOTS, "more prefetches than agreement slots"
        padded = list(self.slots) + [EMPTY_SLOT] * (NUM_SLOTS - len(self.slots))
        out = [self.num_done_backups]
        for slot in padded:
            out += slot.values()
        return out

    @classmethod
    def from_values(cls, values: Sequence[int], num_slots: int) -> L3Progress:
        """The inverse of ``values``, keeping the first ``num_slots`` slots."""
        width = SlotProgress.NUM_FIELDS
        slots = tuple(
            SlotProgress(*(int(v) for v in values[1 + i * width : 1 + (i + 1) * width]))
            for i in range(num_slots)
        )
        return cls(num_done_backups=int(values[0]), slots=slots)


class L3Agreement:
    """A tier's L3 work as the ranks of a tensor-parallel group agree on it.

    Inert alone (tp 1): the tier only calls it for work started under
    ``cache.replicated``. Every method runs on the scheduler thread.
    """

    def __init__(self, tier: StorageTier) -> None:
        self._tier = tier
        # Prefetches holding a slot, in start order (alike on every rank).
        self._slots: list[PrefetchHandle] = []
        # Backups in submission order, the ones that finished on this rank (by id), and
        # those that finished with a stalled call still running here (done once it returns).
        self._backup_order: deque[BackupOp] = deque()
        self._finished_backups: set[int] = set()
        self._awaiting_return: set[int] = set()
        # Backups whose node a flush dropped (by id): their host pages stay reserved, on
        # every rank, until they are agreed finished, then they are freed.
        self._orphans: set[int] = set()

    # ---------------------------------------------------------- prefetches
    @property
    def slot_free(self) -> bool:
        """May another prefetch start (an agreement slot is free)?"""
        return len(self._slots) < NUM_SLOTS

    @property
    def num_slots_in_use(self) -> int:
        """Prefetches holding a slot: running, or settled and draining."""
        return len(self._slots)

    def add_prefetch(self, handle: PrefetchHandle) -> None:
        assert self.slot_free, "a prefetch started with no agreement slot free"
        self._slots.append(handle)

    def holds(self, handle: PrefetchHandle) -> bool:
        """Does ``handle`` still hold its slot (its pages are freed when it drops)?"""
        return handle in self._slots

    @staticmethod
    def complete(handle: PrefetchHandle) -> bool:
        """Every page found has arrived (or could not be placed), on every rank."""
        return handle.agreed is not None and bool(handle.agreed.complete)

    @staticmethod
    def past_deadline(handle: PrefetchHandle) -> bool:
        return handle.agreed is not None and bool(handle.agreed.past_deadline)

    @staticmethod
    def num_landed_pages(handle: PrefetchHandle) -> int:
        """Pages every rank has landed: a rank may hold more, never less."""
        return handle.agreed.num_landed_pages if handle.agreed is not None else 0

    # ------------------------------------------------------------- backups
    def add_backup(self, op: BackupOp) -> None:
        self._backup_order.append(op)

    def backup_finished(self, op: BackupOp, stalled: bool = False) -> None:
        """``op`` finished on this rank: acknowledged once agreed; with ``stalled`` (a call
        of it still runs here) only after ``backup_returned``."""
        (self._awaiting_return if stalled else self._finished_backups).add(id(op))

    def backup_returned(self, op: BackupOp) -> None:
        """The stalled call of a finished backup returned on this rank."""
        if id(op) in self._awaiting_return:
            self._awaiting_return.discard(id(op))
            self._finished_backups.add(id(op))

    def orphan_backups(self) -> list[BackupOp]:
        """The tree is being dropped (a flush, at the same point of the same tick on every
        rank): the backups not agreed finished yet, alike on every rank, lose their nodes;
        their host pages stay reserved until they are agreed finished (``apply`` frees them).

        Returns the newly orphaned backups (whose pages the caller must not free)."""
        orphaned = [op for op in self._backup_order if id(op) not in self._orphans]
        self._orphans.update(id(op) for op in orphaned)
        return orphaned

    def orphaned_pages(self) -> list[PageIds]:
        """Host pages reserved for orphaned backups (held outside the tree)."""
        return [op.host_pages for op in self._backup_order if id(op) in self._orphans]

    @property
    def busy(self) -> bool:
        """Does L3 work still await agreement (a slot in use, a backup not agreed)? Agreed
        state: alike on every rank at the start of a tick."""
        return bool(self._slots or self._backup_order)

    # ------------------------------------------------------------ the tick
    def observe(self, now: float) -> L3Progress:
        """This rank's progress, for the ranks to agree on (changes nothing)."""
        num_done = 0
        for op in self._backup_order:
            if id(op) not in self._finished_backups:
                break
            num_done += 1
        slots = tuple(self._observe_slot(handle, now) for handle in self._slots)
        return L3Progress(num_done_backups=num_done, slots=slots)

    @staticmethod
    def _observe_slot(handle: PrefetchHandle, now: float) -> SlotProgress:
        op = handle.op
        if handle.finished:
            # Draining: whether this rank's I/O for it has returned, its stalled calls
            # included, so that every rank frees the pages at the same tick.
            returned = not handle.in_controller and not len(handle.quarantined)
            return SlotProgress(complete=int(returned))
        queried = op.num_existing >= 0 and not (handle.in_controller and op.host_pages is None)
        if not queried:
            return SlotProgress(past_deadline=int(now >= handle.deadline))
        agreed = handle.agreed
        # Reads start only once the lookup is agreed; until then nothing can be complete.
        read_started = agreed is not None and bool(agreed.queried)
        complete = read_started and not handle.in_controller
        return SlotProgress(
            queried=1, num_found_pages=op.num_existing, num_landed_pages=op.num_landed,
            complete=int(complete), past_deadline=int(now >= handle.deadline),
        )

    def apply(self, agreed: L3Progress) -> None:
        """Take the agreed progress (the minimum of every rank's ``observe``)."""
        for _ in range(agreed.num_done_backups):
            op = self._backup_order.popleft()
            self._finished_backups.discard(id(op))
            orphan = id(op) in self._orphans
            self._orphans.discard(id(op))
            self._tier.settle_backup(op, orphan=orphan)
        for handle, slot in zip(list(self._slots), agreed.slots, strict=False):
            if handle.finished:
                if slot.complete:  # no rank's I/O touches its pages any more
                    self._drop(handle)
                continue
            first = slot.queried and (handle.agreed is None or not handle.agreed.queried)
            handle.agreed = slot
            if first and not self._tier.start_read(handle, slot.num_found_pages):
                # Nothing to read (or no room): complete at once, alike on every rank.
                handle.agreed = SlotProgress(
                    queried=1, num_found_pages=slot.num_found_pages, complete=1,
                    past_deadline=slot.past_deadline,
                )

    def _drop(self, handle: PrefetchHandle) -> None:
        """A settled prefetch leaves its slot; the host pages it did not keep are freed."""
        self._slots.remove(handle)
        self._tier.release_prefetch(handle)
