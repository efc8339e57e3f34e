"""How fast L3 reads pages, as observed, and the prefetch allowance per 1K tokens it calls for.

With ``prefetch_timeout_per_ki_token: "auto"`` a timeout-policy request waits
``base + allowance * tokens / 1024`` (capped by ``prefetch_timeout_max``), where
the allowance follows the store actually attached rather than a guess: an
exponentially weighted moving average of the seconds one page took to read in
recent prefetches, times a safety factor, so that a read going at the usual
speed lands well before its deadline while a store that slows down (or a slow
one from the start) gets proportionally longer. Until ``min_samples`` reads
have finished there is no estimate and the configured default applies.

The samples are whole prefetch reads (``PrefetchOp.read_seconds`` over the
pages that landed), timed on the io thread around the backend calls only:
queueing behind other operations is left to ``prefetch_timeout_base``.

The same samples feed the instance's cost model (``hicache/estimators.py``): a
fit of ``seconds = latency + bytes / bandwidth`` per read (``read_cost``, known
once ``min_samples`` reads finished too), from which ``predict_read(pages)``
prices loading a prefix from this store. It changes nothing of the allowance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.estimators import TransferEstimate, bytes_transfer_estimate

KI_TOKENS = 1024


@dataclass
class ReadTimeEstimate:
    """EWMA of L3 read seconds per page; one per attached backend (scheduler thread only)."""

    page_size: int  # tokens per page
    # Weight of the newest sample: about the last 1 / weight reads dominate.
    weight: float = 0.25
    min_samples: int = 3
    # Headroom over the observed time: a read at 1/safety_factor of the usual speed still
    # lands in time; 3 absorbs the jitter of a shared store without waiting for a dead one.
    safety_factor: float = 3.0
    # Bytes of one page as read (0: unknown, then no latency/bandwidth fit).
    page_bytes: int = 0
    num_samples: int = 0
    _seconds_per_page: float = 0.0
    read_cost: TransferEstimate = field(default_factory=bytes_transfer_estimate)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")

    def observe(self, num_pages: int, seconds: float) -> None:
        """Record a finished read of ``num_pages`` pages that took ``seconds``."""
        if num_pages <= 0 or seconds < 0:
            return  # nothing landed (a miss, a refused call): no speed to learn from
        if self.page_bytes > 0:
            self.read_cost.observe(num_pages * self.page_bytes, seconds)
        sample = seconds / num_pages
        if self.num_samples == 0:
            self._seconds_per_page = sample
        else:
            self._seconds_per_page += self.weight * (sample - self._seconds_per_page)
        self.num_samples += 1

    @property
    def seconds_per_page(self) -> float | None:
        """The average read time of one page; None until ``min_samples`` reads finished."""
        return self._seconds_per_page if self.num_samples >= self.min_samples else None

    def allowance_per_ki_token_s(self) -> float | None:
        """Seconds to allow per 1024 tokens: the observed time with headroom (None: unknown)."""
        per_page = self.seconds_per_page
        if per_page is None:
            return None
        return self.safety_factor * per_page * KI_TOKENS / self.page_size

    def predict_read(self, num_pages: int) -> float | None:
        """Seconds one read of ``num_pages`` pages takes (None: unknown)."""
        if self.page_bytes <= 0:
            return None
        return self.read_cost.predict(num_pages * self.page_bytes)

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Bytes per second a read moves past its latency (None: unknown or unbounded)."""
        per_byte = self.read_cost.seconds_per_unit
        return 1 / per_byte if per_byte else None
