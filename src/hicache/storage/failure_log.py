"""Log lines for L3 failures: each reason once when it first appears, then a summary a minute.

Backends count what went wrong by reason (``StorageStats.failures``: per page,
"corrupt", "missing", "no_space" ...) and so does the storage controller for the
calls it gave up on (``StorageMetrics.failures``: "breaker_open", "get_raised"
...); every reason and what it means are in ``failure_reasons``. Both are
exported in /metrics as ``hicache_l3_failures_total``; this log makes the first
sign of damage visible to whoever reads the server's log too.

``FailureLog.observe`` is handed those cumulative counts after each L3
operation. The first time a reason grows it logs one line saying what the
reason means; later growth of that reason is collected and logged at most
once per ``interval_s`` as "N more in the last T s", so a disk that returns
corrupt pages for every request does not flood the log. Counts that arrive
after the last summary are logged by ``flush`` (at detach).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hicache.storage.failure_reasons import ROUTINE_REASONS, meaning

logger = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 60.0


@dataclass
class _ReasonState:
    seen: int = 0  # the cumulative count at the last observation
    unlogged: int = 0  # counted since the last line about this reason
    last_line_s: float | None = None  # clock time of that line; None: never logged


class FailureLog:
    """Rate-limited log lines about one attached store's failure reasons. Thread-safe."""

    def __init__(
        self,
        store: str,
        *,
        interval_s: float = SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # (source, reason) -> state; source is "backend" or "controller".
        self._reasons: dict[tuple[str, str], _ReasonState] = {}

    def observe(self, source: str, totals: Mapping[str, int]) -> None:
        """Log what grew in ``totals`` (cumulative counts by reason) since the last call."""
        lines: list[tuple[int, str, tuple[object, ...]]] = []
        now = self._clock()
        with self._lock:
            for reason, total in totals.items():
                state = self._reasons.setdefault((source, reason), _ReasonState())
                # Counters only grow; a lower total is a stale read by a concurrent caller.
                new = total - state.seen
                if new <= 0:
                    continue
                state.seen = total
                level = logging.INFO if reason in ROUTINE_REASONS else logging.WARNING
                if state.last_line_s is None:
                    lines.append((level, "L3 %s: %r x%d (%s): %s. Repeats are logged at most "
                                  "once every %.0f s.",
                                  (self.store, reason, new, source, meaning(reason),
                                   self.interval_s)))
                    state.last_line_s = now
                    continue
                state.unlogged += new
                if now - state.last_line_s >= self.interval_s:
                    lines.append(self._summary(level, source, reason, state, total, now))
        for level, message, args in lines:
            logger.log(level, message, *args)

    def flush(self) -> None:
        """Log the counts not yet summarised (the store is being detached)."""
        now = self._clock()
        with self._lock:
            lines = [
                self._summary(
                    logging.INFO if reason in ROUTINE_REASONS else logging.WARNING,
                    source, reason, state, state.seen, now,
                )
                for (source, reason), state in self._reasons.items() if state.unlogged
            ]
        for level, message, args in lines:
            logger.log(level, message, *args)

    def _summary(
        self, level: int, source: str, reason: str, state: _ReasonState, total: int, now: float
    ) -> tuple[int, str, tuple[object, ...]]:
        since_s = now - (state.last_line_s if state.last_line_s is not None else now)
        line = (level, "L3 %s: %r x%d more (%s) in the last %.0f s, %d in all",
                (self.store, reason, state.unlogged, source, since_s, total))
        state.unlogged = 0
        state.last_line_s = now
        return line
