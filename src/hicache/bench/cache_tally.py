"""Prompt tokens and the part of them served from cache, summed over a set of requests.

The restart and agent benchmarks compare such sums between two sets of requests (the
windows before and after a rolling restart; the resumed turns with and without hints).
Invariants: only successful requests count towards the token sums (a failed request
has no cached count to trust), failed ones are counted apart; the cached share is
``cached_tokens / prompt_tokens`` of those raw sums, and a ratio of shares or of counts
is None where its denominator is 0 (never an infinity in the JSON).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.bench.client import TIERS
from hicache.bench.report import RequestRecord


@dataclass(frozen=True)
class CacheTally:
    """Requests of one set and the cache's part of their prompt tokens."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # cached_tokens by the tier that held them (meta_info's cached_tokens_details).
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    @classmethod
    def of(cls, records: Iterable[RequestRecord]) -> CacheTally:
        requests = failed = prompt = cached = 0
        by_tier = dict.fromkeys(TIERS, 0)
        for record in records:
            requests += 1
            if not record.ok:
                failed += 1
                continue
            prompt += record.prompt_tokens
            cached += record.cached_tokens or 0
            for tier, tokens in (record.cached_by_tier or {}).items():
                if tier in by_tier:
                    by_tier[tier] += tokens
        return cls(requests, failed, prompt, cached, by_tier)

    @property
    def cached_share(self) -> float | None:
        """Cached prompt tokens over prompt tokens; None without any prompt token."""
        return ratio(self.cached_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cached_share": self.cached_share}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
