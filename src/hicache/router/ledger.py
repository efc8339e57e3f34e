"""One worker's in-flight prefill work as the router sent it, in predicted seconds and
in pages.

The proxy ``admit``s each request it sends with the prefill time the policy predicted
for it there (``RouteDecision.predicted_prefill_s``; 0 for a policy that predicts
nothing) and the pages it computes there (``RouteDecision.prefill_pages``: what it
does not find cached), and tells the entry when the answer's first byte came back (``first_token``)
and when the request ended in any way (``close``: whole, failed, client gone). The
predicted_ttft policy reads ``queued_s``: how long a prefill sent there now waits
before it starts. tier_aware's ``pending_prefill`` load term reads ``pending_pages``:
the pages of prefill sent there still waiting for their first token.

``queued_s`` is the predicted prefill of the entries still waiting for their first
token, less the time since the queue last moved (an entry joined an empty queue, or
one got its first token): the worker has been working on that queue meanwhile. What
is taken off never exceeds the oldest waiting entry's prediction: that one has not
produced its first token, so the worker has not finished even it, and a prediction
that came out short must not empty the queue behind it. It is never negative, and 0
with nothing pending.

``in_flight`` lists every entry that has not ended with the device pages it holds there
(``held_pages`` at admission: its context and output) and when it is predicted to end:
a waiting one after the prefill queued up to it, then a decode; a decoding one a decode
after its first token. The decode is the worker's recent one, measured here: a moving
average of first token to end over the entries that had both (0 until one had).
``device_room.room_wait_s`` reads it.

Invariants: an entry is counted at most once in ``pending`` and once in
``decoding``; ``first_token`` and ``close`` are idempotent, in any order (a close
before the first token frees the entry's prefill seconds), so no path (failure,
retry, client disconnect) leaks seconds into the queue. Everything runs on the
router's event loop: no locks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from hicache.router.device_room import InFlight

# The weight of the newest decode time in the moving average: the last few dominate.
DECODE_WEIGHT = 0.2


class PrefillLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: dict[int, float] = {}  # entry id -> predicted prefill seconds
        self._pending_pages: dict[int, float] = {}  # entry id -> pages it computes
        self._decoding: set[int] = set()
        self._held: dict[int, float] = {}  # entry id -> device pages, until it ends
        self._first_at: dict[int, float] = {}  # decoding entry id -> its first token's time
        self.decode_s: float | None = None  # first token to end, moving average
        self._ids = itertools.count()
        self._moved_at = clock()  # when the pending queue last moved

    def admit(self, predicted_s: float, prefill_pages: float = 0.0,
              held_pages: float = 0.0) -> LedgerEntry:
        """A request sent to the worker, predicted to take ``predicted_s`` of prefill, to
        compute ``prefill_pages`` there and to hold ``held_pages`` of its device while it
        runs."""
        entry_id = next(self._ids)
        if not self._pending:
            self._moved_at = self._clock()  # an idle worker starts on it now
        self._pending[entry_id] = max(0.0, predicted_s)
        self._pending_pages[entry_id] = max(0.0, prefill_pages)
        if held_pages > 0:
            self._held[entry_id] = held_pages
        return LedgerEntry(self, entry_id, self._clock())

    def in_flight(self) -> tuple[InFlight, ...]:
        """Every entry not ended that holds device pages: its pages and the seconds until
        it is predicted to end."""
        if not self._held:
            return ()
        now = self._clock()
        decode = self.decode_s or 0.0
        out: list[InFlight] = []
        if self._pending:
            oldest = next(iter(self._pending.values()))
            worked = min(now - self._moved_at, oldest)
            ahead = 0.0
            for entry_id, predicted in self._pending.items():
                ahead += predicted
                pages = self._held.get(entry_id)
                if pages is not None:
                    out.append(InFlight(max(0.0, ahead - worked) + decode, pages))
        for entry_id in self._decoding:
            pages = self._held.get(entry_id)
            if pages is not None:
                out.append(InFlight(max(0.0, self._first_at[entry_id] + decode - now), pages))
        return tuple(out)

    def queued_s(self) -> float:
        """Predicted seconds before a prefill sent now would start."""
        if not self._pending:
            return 0.0
        oldest = next(iter(self._pending.values()))  # dicts keep the order of admission
        worked = min(self._clock() - self._moved_at, oldest)
        return max(0.0, sum(self._pending.values()) - worked)

    @property
    def pending_pages(self) -> float:
        """Pages of prefill sent there whose first token has not come back."""
        return sum(self._pending_pages.values())

    @property
    def prefilling(self) -> int:
        return len(self._pending)

    @property
    def decoding(self) -> int:
        """Requests past their first token, not yet ended (the worker decodes them)."""
        return len(self._decoding)

    def _first_token(self, entry_id: int) -> None:
        self._pending_pages.pop(entry_id, None)
        if self._pending.pop(entry_id, None) is not None:
            self._moved_at = self._clock()
            self._decoding.add(entry_id)
            self._first_at[entry_id] = self._moved_at

    def _close(self, entry_id: int) -> None:
        self._pending_pages.pop(entry_id, None)
        if self._pending.pop(entry_id, None) is not None:
            self._moved_at = self._clock()
        self._decoding.discard(entry_id)
        self._held.pop(entry_id, None)
        first_at = self._first_at.pop(entry_id, None)
        if first_at is not None:
            seconds = self._clock() - first_at
            old = self.decode_s
            self.decode_s = seconds if old is None else old + DECODE_WEIGHT * (seconds - old)


class LedgerEntry:
    """One request's place in its worker's ledger."""

    def __init__(self, ledger: PrefillLedger, entry_id: int, admitted_at: float) -> None:
        self._ledger = ledger
        self._id = entry_id
        self.admitted_at = admitted_at
        self.first_token_s: float | None = None  # seconds from admission to the first byte
        self.closed = False

    def first_token(self) -> float | None:
        """The first byte came back: its prefill is done. The measured seconds since
        admission the first time; None on a repeat or after ``close``."""
        if self.first_token_s is not None or self.closed:
            return None
        self.first_token_s = self._ledger._clock() - self.admitted_at
        self._ledger._first_token(self._id)
        return self.first_token_s

    def close(self) -> None:
        """The request ended (whole, failed or abandoned): out of the ledger."""
        if not self.closed:
            self.closed = True
            self._ledger._close(self._id)
