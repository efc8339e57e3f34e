"""Which worker holds which page in which tier, from the workers' KV events.

Page hashes are chained (``events.hashing``): a page's hash names its whole
prefix. So the index needs no tree: a flat dict from page hash to a bitmask of
the workers holding that page is enough, and a request's overlap on a worker is
the number of its leading pages whose mask has the worker's bit. One walk over
the request's pages serves every worker and every tier at once, and it stops at
the first page no candidate holds anywhere (``overlaps``).

Tiers, from the top (the media of Dynamo's KV events):

- ``GPU`` (L1) and ``CPU_PINNED`` (L2) are private to a worker: one mask per
  page and tier, plus each worker's own page sets so that clearing or removing
  a worker costs its own pages, not the whole index. What a worker uses is
  bounded by what it announced and freed when it goes.
- ``EXTERNAL`` (L3) is shared by all workers: a page any worker stored there
  counts as external for every worker. Workers never announce L3 removals (the
  pool evicts on its own), so this set only approximates the pool, the
  shared-pool query is the truth, and the set is capped (oldest forgotten first).

A page known to a worker in a tier counts for the tiers below it too: the host
overlap counts pages on device or host, the external overlap pages anywhere.

Pins (``BlockPinned``, sent by workers whose events config has ``pin_events``): a page
a worker pinned on its host (or device) tier is a sure hit there, whatever else the
index heard of it, so it counts as held on that worker's host until the worker unpins
it, removes it from its host tier (the worker's word on its own pages wins over a pin
whose end was not announced), or is cleared. A pin in EXTERNAL says the page is in the
shared pool. Pinned pages are kept per worker like the private tiers, so clearing a
worker costs its own pins.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Final

from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockPinned,
    BlockStored,
    KVEventBatch,
)
from hicache.router.types import TierOverlap

# The bit of a worker the index has no pages of: never set in a mask, so such a
# worker matches only through the shared pool.
_NO_PAGES_BIT: Final = 0
# Pages kept in the shared (EXTERNAL) set before the oldest are forgotten.
DEFAULT_MAX_EXTERNAL_PAGES: Final = 4_000_000

# Media names other engines use for the same tiers (vLLM says "CPU"); an event
# without a medium comes from a worker that only tracks its device pool.
_TIER_OF_MEDIUM: Final[dict[str | None, str]] = {
    None: MEDIUM_GPU,
    MEDIUM_GPU: MEDIUM_GPU,
    MEDIUM_CPU: MEDIUM_CPU,
    "CPU": MEDIUM_CPU,
    MEDIUM_EXTERNAL: MEDIUM_EXTERNAL,
}


class UnknownMediumError(ValueError):
    """An event names a medium the index does not know; the batch was not applied."""


class PageIndex:
    """``TierIndex`` over per-tier bitmasks; see the module docstring.

    Safe to use from several threads (one lock; a lookup holds it for one walk).
    """

    def __init__(self, max_external_pages: int = DEFAULT_MAX_EXTERNAL_PAGES) -> None:
        if max_external_pages <= 0:
            raise ValueError(f"max_external_pages must be positive, got {max_external_pages}")
        self.max_external_pages = max_external_pages
        self._lock = threading.Lock()
        self._bits: dict[str, int] = {}  # worker -> its bit in the masks
        self._free_bits: list[int] = []  # bits of removed workers, reused first
        # page hash -> mask of the workers holding it, per private tier
        self._gpu: dict[int, int] = {}
        self._cpu: dict[int, int] = {}
        # worker -> its pages per private tier (what clear/remove must undo)
        self._gpu_pages: dict[str, set[int]] = {}
        self._cpu_pages: dict[str, set[int]] = {}
        # page hash -> mask of the workers that pinned it locally; worker -> its pins
        self._pinned: dict[int, int] = {}
        self._pinned_pages: dict[str, set[int]] = {}
        # The shared pool as announced, oldest first (a dict is an ordered set).
        self._external: dict[int, None] = {}

    # ------------------------------------------------------------- updates
    def apply(self, worker: str, batch: KVEventBatch) -> None:
        """Apply one batch in order. A batch naming an unknown medium raises
        ``UnknownMediumError`` before anything is applied."""
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                continue
            if event.medium not in _TIER_OF_MEDIUM:
                raise UnknownMediumError(
                    f"worker {worker} sent an event for medium {event.medium!r}; known media: "
                    f"{', '.join(m for m in _TIER_OF_MEDIUM if m is not None)} (or none: GPU)"
                )
        with self._lock:
            bit = self._bit_locked(worker)
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._clear_locked(worker, bit)
                    continue
                tier = _TIER_OF_MEDIUM[event.medium]
                if isinstance(event, BlockPinned):
                    self._pin_locked(worker, bit, tier, event.block_hashes, event.pinned)
                elif isinstance(event, BlockStored):
                    self._store_locked(worker, bit, tier, event.block_hashes)
                else:
                    self._remove_locked(worker, bit, tier, event.block_hashes)

    def clear_worker(self, worker: str) -> None:
        """Forget a worker's device and host pages (the shared pool is not its own)."""
        with self._lock:
            bit = self._bits.get(worker)
            if bit is not None:
                self._clear_locked(worker, bit)

    def remove_worker(self, worker: str) -> None:
        with self._lock:
            bit = self._bits.pop(worker, None)
            if bit is None:
                return
            self._clear_locked(worker, bit)
            del self._gpu_pages[worker], self._cpu_pages[worker], self._pinned_pages[worker]
            self._free_bits.append(bit)

    # -------------------------------------------------------------- lookup
    def overlaps(
        self, page_hashes: Sequence[int], workers: Sequence[str],
    ) -> dict[str, TierOverlap]:
        """Per worker, its longest prefix of ``page_hashes`` on device, on device
        or host, and anywhere (its own tiers or the shared pool). A worker the
        index has no events from overlaps only through the shared pool."""
        num_pages = len(page_hashes)
        gpu_len: dict[int, int] = {}
        host_len: dict[int, int] = {}
        ext_len: dict[int, int] = {}
        with self._lock:
            bits = {worker: self._bits.get(worker, _NO_PAGES_BIT) for worker in workers}
            candidates = 0
            for bit in bits.values():
                candidates |= 1 << bit
            # Workers still matching every page so far, per tier: gpu <= host <= ext.
            gpu_alive = host_alive = ext_alive = candidates
            gpu_get, cpu_get, external = self._gpu.get, self._cpu.get, self._external
            pinned_get = self._pinned.get
            for position, page in enumerate(page_hashes):
                on_gpu = gpu_get(page, 0)
                local = on_gpu | cpu_get(page, 0) | pinned_get(page, 0)
                if gpu_alive & ~on_gpu:
                    _record(gpu_alive & ~on_gpu, position, gpu_len)
                    gpu_alive &= on_gpu
                if host_alive & ~local:
                    _record(host_alive & ~local, position, host_len)
                    host_alive &= local
                if page not in external and ext_alive & ~local:
                    _record(ext_alive & ~local, position, ext_len)
                    ext_alive &= local
                    if not ext_alive:  # no candidate left in any tier (host, gpu <= ext)
                        break
            if ext_alive:  # these matched every page
                _record(gpu_alive, num_pages, gpu_len)
                _record(host_alive, num_pages, host_len)
                _record(ext_alive, num_pages, ext_len)
        return {
            worker: TierOverlap(
                gpu=gpu_len.get(bit, 0), host=host_len.get(bit, 0), external=ext_len.get(bit, 0),
            )
            for worker, bit in bits.items()
        }

    def num_pages(self) -> int:
        """Index entries, per tier: pages some worker holds on device, pages some
        worker holds on host, pages announced to the shared pool (a page in two
        tiers counts twice). Constant time: metrics may ask at every scrape."""
        with self._lock:
            return len(self._gpu) + len(self._cpu) + len(self._external)

    def worker_pinned_pages(self, worker: str) -> int:
        """How many pages a worker has pinned now, as its events said."""
        with self._lock:
            return len(self._pinned_pages.get(worker, ()))

    def worker_pages(self, worker: str) -> dict[str, int]:
        """How many pages a worker announced per tier it owns (for metrics)."""
        with self._lock:
            return {
                MEDIUM_GPU: len(self._gpu_pages.get(worker, ())),
                MEDIUM_CPU: len(self._cpu_pages.get(worker, ())),
            }

    def check_integrity(self) -> None:
        """The masks and the per-worker sets describe the same pages."""
        with self._lock:
            assert len(self._external) <= self.max_external_pages
            assert not set(self._bits.values()) & set(self._free_bits)
            assert _NO_PAGES_BIT not in self._bits.values()
            for masks, pages in ((self._gpu, self._gpu_pages), (self._cpu, self._cpu_pages),
                                 (self._pinned, self._pinned_pages)):
                assert set(pages) == set(self._bits)
                expected: dict[int, int] = {}
                for worker, held in pages.items():
                    for page in held:
                        expected[page] = expected.get(page, 0) | 1 << self._bits[worker]
                assert masks == expected, "page masks disagree with the workers' page sets"

    # ------------------------------------------------------------ internals
    def _bit_locked(self, worker: str) -> int:
        bit = self._bits.get(worker)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bits) + 1
            self._bits[worker] = bit
            self._gpu_pages[worker] = set()
            self._cpu_pages[worker] = set()
            self._pinned_pages[worker] = set()
        return bit

    def _tier_locked(self, worker: str, tier: str) -> tuple[dict[int, int], set[int]]:
        if tier == MEDIUM_GPU:
            return self._gpu, self._gpu_pages[worker]
        return self._cpu, self._cpu_pages[worker]

    def _store_locked(self, worker: str, bit: int, tier: str, hashes: Iterable[int]) -> None:
        if tier == MEDIUM_EXTERNAL:
            external = self._external
            for page in hashes:
                external.pop(page, None)  # re-announced: now the newest
                external[page] = None
            excess = len(external) - self.max_external_pages
            if excess > 0:
                for page in list(iter(external))[:excess]:
                    del external[page]
            return
        masks, held = self._tier_locked(worker, tier)
        flag = 1 << bit
        for page in hashes:
            masks[page] = masks.get(page, 0) | flag
            held.add(page)

    def _remove_locked(self, worker: str, bit: int, tier: str, hashes: Iterable[int]) -> None:
        if tier == MEDIUM_EXTERNAL:
            # Not sent by our workers; another engine's removal is still news.
            for page in hashes:
                self._external.pop(page, None)
            return
        masks, held = self._tier_locked(worker, tier)
        if tier == MEDIUM_CPU:
            hashes = list(hashes)
            # Gone from its host tier: no longer a sure hit there, pinned or not.
            _unmark(self._pinned, self._pinned_pages[worker], bit, hashes)
        _unmark(masks, held, bit, hashes)

    def _pin_locked(
        self, worker: str, bit: int, tier: str, hashes: Iterable[int], pinned: bool,
    ) -> None:
        if tier == MEDIUM_EXTERNAL:
            if pinned:  # pinned in the shared pool: it is there
                self._store_locked(worker, bit, tier, hashes)
            return
        held = self._pinned_pages[worker]
        if not pinned:
            _unmark(self._pinned, held, bit, hashes)
            return
        flag = 1 << bit
        masks = self._pinned
        for page in hashes:
            masks[page] = masks.get(page, 0) | flag
            held.add(page)

    def _clear_locked(self, worker: str, bit: int) -> None:
        for tier in (MEDIUM_GPU, MEDIUM_CPU):
            _, held = self._tier_locked(worker, tier)
            self._remove_locked(worker, bit, tier, list(held))
        held = self._pinned_pages[worker]
        _unmark(self._pinned, held, bit, list(held))


def _unmark(masks: dict[int, int], held: set[int], bit: int, hashes: Iterable[int]) -> None:
    """Take ``bit`` off ``hashes`` in ``masks`` (those the worker holds in ``held``)."""
    keep = ~(1 << bit)
    for page in hashes:
        if page in held:
            held.discard(page)
            mask = masks[page] & keep
            if mask:
                masks[page] = mask
            else:
                del masks[page]


def _record(mask: int, position: int, into: dict[int, int]) -> None:
    """Note ``position`` as the overlap of every worker whose bit is in ``mask``."""
    while mask:
        low = mask & -mask
        into[low.bit_length() - 1] = position
        mask ^= low
