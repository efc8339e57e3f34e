"""Circuit breaker in front of L3: stop calling a store that keeps failing, retry later.

Without it a dead L3 costs every request a failed call (often a timeout). After
``failures`` consecutive failed calls the breaker opens: calls are refused at
once (a cache miss) for a backoff period; then one trial call is let through
(half-open). Success closes the breaker; another failure re-opens it with the
backoff doubled, up to ``backoff_max``. A call that hangs past its deadline
``trip``s the breaker open at once, without waiting for more failures: a store
that stops answering is down, and each further call would cost a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import Enum

logger = logging.getLogger(__name__)


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 3,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "L3",
    ) -> None:
        self._threshold = failures
        self._base = backoff_base
        self._max = backoff_max
        self._clock = clock
        self._name = name
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._backoff = backoff_base
        self._retry_at = 0.0
        self._trial_in_flight = False
        self.num_refused = 0
        self.num_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go to the store now? Refusals are counted."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if (
                self._state is BreakerState.OPEN
                and self._clock() >= self._retry_at
                and not self._trial_in_flight
            ):
                self._state = BreakerState.HALF_OPEN
                self._trial_in_flight = True
                return True
            self.num_refused += 1
            return False

    def record_success(self) -> None:
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                logger.info("%s is answering again: circuit closed", self._name)
            self._state = BreakerState.CLOSED
            self._consecutive = 0
            self._backoff = self._base
            self._trial_in_flight = False

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff = min(self._max, self._backoff * 2)
                self._open(reason)
            elif self._state is BreakerState.CLOSED and self._consecutive >= self._threshold:
                self._open(reason)

    def trip(self, reason: str) -> None:
        """Open now, whatever the count (a call hung past its deadline).

        A trial call that hangs doubles the backoff, as any failed trial does;
        tripping an open breaker restarts its backoff from now.
        """
        with self._lock:
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff = min(self._max, self._backoff * 2)
            self._open(reason)

    def _open(self, reason: str) -> None:
        self._state = BreakerState.OPEN
        self._trial_in_flight = False
        self._retry_at = self._clock() + self._backoff
        self.num_opened += 1
        logger.warning(
            "%s failing (%s, %d calls in a row): circuit open, treating L3 as a miss "
            "for %.1f s", self._name, reason, self._consecutive, self._backoff,
        )
