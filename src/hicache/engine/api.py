"""What the server sees of the engine: requests in, streamed outputs back.

The engine runs its scheduler on its own thread; these types cross between
that thread and the server's event loop, so they are immutable. Validation
errors are ``RequestError`` with a message fit for a 4xx response.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class RequestError(ValueError):
    """A request the engine refuses (bad sampling parameters, too long, bad token ids)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; defaults follow the OpenAI API (temperature 1, top_p 1)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = all tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids out of vocabulary [0, {vocab_size}): {bad}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""  # the engine assigns one when empty
    # Cache salt: requests with different keys never share cached KV.
    extra_key: str | None = None


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens whose KV was reused, by the tier it came from."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True)
class GenerateOutput:
    """One streamed step of a request (the last one has ``finished``)."""

    rid: str
    token_ids: tuple[int, ...]  # new tokens since the previous output
    text: str  # new text since the previous output (stop strings trimmed)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: CachedTokens
    # When finished: seconds from arrival to first token, and to the end.
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None  # set with finish_reason "abort" when the engine failed it


class EngineProtocol(Protocol):
    """The engine as the HTTP server uses it."""

    model_name: str
    vocab_size: int
    max_context_len: int

    def tokenize(self, text: str) -> list[int]: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Validate (raising RequestError before anything is queued), then stream outputs.

        Closing the iterator early (client gone) aborts the request and frees
        everything it held.
        """
        ...

    def abort(self, rid: str) -> None: ...

    def flush_cache(self) -> bool:
        """Drop every cached prefix (all tiers but L3); False when requests are running."""
        ...

    def is_idle(self) -> bool: ...

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for /metrics (cached tokens by source, hit rate, pools ...)."""
        ...

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        """Attach (or re-attach: policies only) L3; raises StorageError/ConfigError."""
        ...

    def detach_storage(self) -> None: ...

    def storage_status(self) -> dict[str, Any]: ...
