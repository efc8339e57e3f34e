"""When a worker leaves routing: failures in a row, never slowness alone.

The registry (``workers.py``) hears of each worker from its health probes (``GET
/health``) and from the requests the proxies send it, and sorts what it hears:

- REFUSED: the connection was refused. Nothing listens at the worker's address
  (stopped, or restarting: its caches are gone with it), so it leaves routing at
  once, and its index entries with it.
- FAILED: ``/health`` answered other than 200, a request got a 5xx, or the connection
  broke before an answer. A worker leaves routing after ``FAILURES_TO_EJECT`` of them
  in a row: one failure may be the request's own.
- TIMED_OUT: a probe or a connection was not answered in time. On a loaded machine any
  worker is slow at times (its /health waits for its engine), and a slow worker still
  serves: a timeout is no failure. Only a worker that answered nothing at all, probes
  and requests alike, for ``HUNG_AFTER_S`` is taken for hung, and then taken out only
  while another worker of its pool is healthy: the last one stays, since answering
  every request with a 503 serves nobody.
- ANSWERED: ``/health`` 200, or any answer below 500 to a request. It ends a streak of
  failures and of timeouts.

A worker out of routing comes back at its first ``/health`` 200 (rediscovered by
the registry). ``WorkerHealth`` is one worker's record; it decides nothing about the
pool, which the registry does.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Final

import httpx

# Failures in a row that take a worker out of routing.
FAILURES_TO_EJECT: Final = 3
# No answer at all for this long (only timeouts) means a hung worker.
HUNG_AFTER_S: Final = 30.0


class Signal(enum.Enum):
    ANSWERED = "answered"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    REFUSED = "refused"


def signal_of_error(error: BaseException) -> Signal:
    """What a failed HTTP exchange with a worker says about it."""
    if isinstance(error, httpx.TimeoutException):  # ConnectTimeout too: a full backlog
        return Signal.TIMED_OUT
    if isinstance(error, httpx.ConnectError):
        return Signal.REFUSED
    return Signal.FAILED


def signal_of_status(status: int) -> Signal:
    """What a worker's answer to a proxied request says about it."""
    return Signal.FAILED if status >= 500 else Signal.ANSWERED


class Verdict(enum.Enum):
    KEEP = "keep"
    EJECT = "eject"  # out of routing now
    HUNG = "hung"  # out of routing unless it is the last healthy worker of its pool


@dataclass
class WorkerHealth:
    """One worker's streaks: failures in a row, and when it last answered anything."""

    failures: int = 0
    last_answer: float = field(default_factory=time.monotonic)
    slow: bool = False  # timed out since its last answer (logged once per streak)
    kept_hung: bool = False  # hung but kept as its pool's last (logged once per streak)

    def hear(self, signal: Signal, now: float | None = None) -> Verdict:
        now = time.monotonic() if now is None else now
        if signal is Signal.ANSWERED:
            self.failures, self.last_answer, self.slow, self.kept_hung = 0, now, False, False
            return Verdict.KEEP
        if signal is Signal.REFUSED:
            self.failures += 1
            return Verdict.EJECT
        if signal is Signal.FAILED:
            self.failures += 1
            return Verdict.EJECT if self.failures >= FAILURES_TO_EJECT else Verdict.KEEP
        self.slow = True
        return Verdict.HUNG if now - self.last_answer >= HUNG_AFTER_S else Verdict.KEEP

    def reset(self) -> None:
        """Back in routing: a fresh record."""
        self.hear(Signal.ANSWERED)
