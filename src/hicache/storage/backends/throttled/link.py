"""A simulated link to a store: each call waits its latency, then its bytes' turn on a
bandwidth that all calls share.

Invariants:
- A call alone takes ``latency_s + nbytes / bandwidth`` longer than it would unthrottled.
- Bandwidth is per link (one per backend instance and direction): calls in flight at once
  queue their bytes behind each other ("next free time"), so two parallel calls of N bytes
  each end N/bandwidth and 2N/bandwidth after their latency; latency is per call and
  overlaps freely.
- The lock guards only the arithmetic; the wait happens outside it, on the calling
  thread, so a call abandoned past its deadline (``storage.deadline``) holds nothing another
  call needs. A call that ends up not moving its bytes does not give its slot back: the
  store was busy for it all the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Link:
    """One direction's latency and shared bandwidth (see the module docstring)."""

    def __init__(
        self,
        latency_s: float,
        bandwidth: float | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0 s, got {latency_s}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {bandwidth}")
        self.latency_s = latency_s
        self.bandwidth = bandwidth  # bytes per second; None: no limit
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_free = 0.0  # when the bytes queued so far have all gone through

    def delay(self, nbytes: int) -> float:
        """Wait as a call moving ``nbytes`` over this link would; returns the seconds waited."""
        now = self._clock()
        end = now + self.latency_s
        if self.bandwidth is not None and nbytes > 0:
            with self._lock:
                end = max(end, self._next_free) + nbytes / self.bandwidth
                self._next_free = end
        wait = end - now
        if wait > 0:
            self._sleep(wait)
            return wait
        return 0.0
