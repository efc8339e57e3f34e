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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
