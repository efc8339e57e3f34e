"""How long a request would wait for device room on a worker, before its own prefill.

A worker admits a request only when its device pool has room for the request's context
beside the pages the requests running there hold (``engine/scheduler.py``'s admission:
cached pages nobody uses are evicted for it, pages in use are not). Where one worker's
device holds only a few requests (a small device pool, long prompts), a request sent there
waits until enough of those running end, however short the prefill queue: at the router
sweep's small-L1 points this was the larger part of a turn's TTFT behind either router
(docs/benchmarks.md, 2026-12-02).

The router knows what it sent each worker (``ledger.py``): each request's pages and when
it is predicted to end (its prefill ahead in the queue, then the worker's recent decode
time). ``room_wait_s`` frees those pages in the order they are predicted to end until the
new request fits. Invariants: 0 when the worker's capacity is unknown or the request fits
now; never negative; never more than the latest predicted end (the request fits once
everything sent there has ended, or it never would, which the engine reports as an error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InFlight:
    """A request the router sent a worker that has not ended."""

    free_in_s: float  # predicted seconds until it ends, and its pages are free
    pages: float  # device pages it holds while it runs (context and output)


def room_wait_s(capacity_pages: float | None, in_flight: Sequence[InFlight],
                pages: float) -> float:
    """Seconds until ``pages`` device pages are free on a worker of ``capacity_pages``
    pages beside ``in_flight`` (0: it fits now, or the capacity is unknown)."""
    if capacity_pages is None or capacity_pages <= 0:
        return 0.0
    held = sum(f.pages for f in in_flight)
    if held + pages <= capacity_pages:
        return 0.0
    wait = 0.0
    for flight in sorted(in_flight, key=lambda f: f.free_in_s):
        held -= flight.pages
        wait = max(wait, flight.free_in_s)
        if held + pages <= capacity_pages:
            break
    return max(0.0, wait)
