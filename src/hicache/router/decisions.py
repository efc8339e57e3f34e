"""The router's last routing decisions, for ``GET /decisions?limit=N``.

Each routed request's decision: a sequence number, the request id the client gave it
(/generate's ``rid``; None without one), the chosen worker (its URL without
credentials), the policy, the predicted TTFT and its terms (tier_aware and predicted_ttft), the
figures priced from other workers or defaults, the conversation's home worker
(``affinity.py``), every worker's logit and cached prefix
(``[device, device or host, any tier]`` pages), whether the request streamed, and,
once its first byte came back, the measured TTFT. Measured is the time from sending
the request to the worker to its answer's first body byte; for a request that does
not stream that byte comes with the whole answer (a time to last token), so it is
kept apart (``"stream": false``) and kept out of the TTFT histograms (``metrics.py``).

Invariant: at most ``MAX_DECISIONS`` are kept, the oldest dropped first; the log
lives on the router's event loop.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any, Final

from hicache.router.credentials import redact
from hicache.router.types import RouteDecision

MAX_DECISIONS: Final = 1024
DEFAULT_LIMIT: Final = 100


class DecisionLog:
    def __init__(self, capacity: int = MAX_DECISIONS) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._ids = itertools.count(1)

    def record(self, decision: RouteDecision, stream: bool,
               rid: str | None = None) -> dict[str, Any]:
        """Log a decision; the returned entry takes the measured TTFT later. ``rid``: the
        request id the client gave the request, if any (the worker knows it by it too)."""
        entry: dict[str, Any] = {
            "id": next(self._ids), "rid": rid, "time": time.time(),
            "worker": redact(decision.worker),
            "policy": decision.policy, "stream": stream,
            "predicted_ttft_s": decision.predicted_ttft_s, "terms": dict(decision.terms),
            "fallbacks": list(decision.fallbacks), "measured_ttft_s": None,
            # The conversation's home (its last turn's worker), where the policy has one.
            "home": None if decision.home is None else redact(decision.home),
            # tier_aware: the pages of prefill the chosen worker computes for it.
            "prefill_pages": decision.prefill_pages,
            # tier_aware: the overlap weight those pages were scored with.
            "overlap_weight": decision.overlap_weight,
            # Every worker's score and cached prefix (pages on device, device or host, any
            # tier): why this worker and not another.
            "logits": {redact(url): logit for url, logit in decision.logits.items()},
            "overlaps": {
                redact(url): [overlap.gpu, overlap.host, overlap.external]
                for url, overlap in decision.overlaps.items()
            },
        }
        self._entries.append(entry)
        return entry

    def last(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` decisions, newest last."""
        if limit <= 0:
            return []
        return list(itertools.islice(reversed(self._entries), limit))[::-1]
