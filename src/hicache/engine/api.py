"""What the server sees of the engine: requests in, streamed outputs back.

The engine runs its scheduler on its own thread; these types cross between
that thread and the server's event loop, so they are immutable. Validation
errors are ``RequestError`` with a message fit for a 4xx response.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol


class RequestError(ValueError):
    """A request the engine refuses (bad sampling parameters, too long, bad token ids)."""


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "tool_calls"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "tool_calls")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``text``: the JSON schema (as JSON text), the
    regex or the EBNF grammar (root rule ``root``); empty for ``json_object``; for
    ``tool_calls`` a JSON object: ``call_schema`` (one call's) and ``max_calls`` (see
    hicache.server.structured_output)."""

    kind: GrammarKind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """From a schema given as a dict (or JSON text). Keys keep their order: the output
        writes properties in the order the schema declares them."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise RequestError(f"json_schema is not valid JSON: {error}") from error
        if not isinstance(schema, dict | bool):
            raise RequestError(
                f"json_schema must be a JSON object, got {type(schema).__name__}"
            )
        return cls("json_schema", json.dumps(schema))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; defaults follow the OpenAI API (temperature 1, top_p 1)."""

    max_new_tokens: int = 128  # 0: prefill only (the prompt is computed and cached)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = all tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # Until this many tokens are out, eos and stop tokens cannot be drawn and stop
    # strings do not end the request (SGLang's min_new_tokens, OpenAI's min_tokens).
    min_new_tokens: int = 0
    # SGLang/HF: logits of tokens seen in prompt or output divided by it when positive,
    # multiplied when negative (1 = off).
    repetition_penalty: float = 1.0
    # OpenAI: subtracted from the logits per occurrence / once for any occurrence of a
    # token in the output so far (0 = off).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # What the output must match (hicache.engine.grammar compiles and enforces it);
    # None: unconstrained.
    grammar: GrammarSpec | None = None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise RequestError(
                f"max_tokens must be a non-negative integer, got {self.max_new_tokens}"
            )
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
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise RequestError(
                f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens}"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        # Bounds as SGLang's: a repetition penalty of 0 would divide by zero.
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise RequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise RequestError(f"{name} must be in [-2, 2], got {value}")


# Most top logprobs a request may ask per position (OpenAI's chat allows 20).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobParams:
    """Which log probabilities a request wants back.

    They are of the model's own distribution: ``log_softmax`` of its raw logits,
    before penalties, temperature and top-k/top-p (SGLang's default).
    """

    top_n: int = 0  # the N most likely tokens at each position, with theirs
    token_ids: tuple[int, ...] = ()  # these tokens' logprobs at each position
    # Prompt position from which input logprobs are returned (SGLang's
    # logprob_start_len); -1 (or the prompt's length): none, output logprobs only.
    input_from: int = -1

    def validate(self, vocab_size: int, prompt_len: int) -> None:
        if not isinstance(self.top_n, int) or not 0 <= self.top_n <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_n}"
            )
        bad = [t for t in self.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token_ids_logprob out of vocabulary [0, {vocab_size}): {bad}")
        if not -1 <= self.input_from <= prompt_len:
            raise RequestError(
                f"logprob_start_len must be -1 or within the prompt's {prompt_len} tokens, "
                f"got {self.input_from}"
            )

    def wants_input(self, prompt_len: int) -> bool:
        return 0 <= self.input_from < prompt_len


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log probabilities: of its token, of the top ones, of asked ones."""

    token_id: int
    logprob: float | None  # None for the prompt's first token: nothing predicts it
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    asked: tuple[float, ...] = ()  # of LogprobParams.token_ids, in their order


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's KV is handed over (SGLang's bootstrap_* fields): the
    prefill instance's bootstrap server and the room both instances know the request by."""

    host: str
    port: int
    room: int


class HintKind(str, Enum):
    PIN = "pin"
    UNPIN = "unpin"
    RETAIN = "retain"
    PREFETCH = "prefetch"
    DEMOTE = "demote"


class HintOutcomeKind(str, Enum):
    ACCEPTED = "accepted"
    CLIPPED = "clipped"
    DEFERRED = "deferred"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Hint:
    kind: HintKind
    # The prefix the hint is about. None only on a request's own hints (GenerateRequest.hints):
    # then it is that request's prompt + generated tokens, applied when the request finishes.
    input_ids: tuple[int, ...] | None = None
    ttl_s: float | None = None      # pin / retain: None = the configured default
    tier: str = "host"              # pin only: "host" (L2) or "l3"
    tenant: str = "default"         # pins are budgeted per tenant and in total
    extra_key: str | None = None    # cache salt, as GenerateRequest.extra_key


@dataclass(frozen=True)
class HintOutcome:
    index: int
    kind: HintKind
    outcome: HintOutcomeKind
    tokens: int = 0            # tokens of the prefix the hint now covers
    clipped_tokens: int = 0    # tokens asked for but not covered (clipped)
    reason: str = ""           # why (clipped / deferred / rejected), empty when accepted

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind.value, "outcome": self.outcome.value,
                "tokens": self.tokens, "clipped_tokens": self.clipped_tokens,
                "reason": self.reason}


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""  # the engine assigns one when empty
    # Cache salt: requests with different keys never share cached KV.
    extra_key: str | None = None
    logprobs: LogprobParams | None = None  # None: no log probabilities
    # Set on the requests a router sends to a prefill and a decode instance (disaggregation).
    bootstrap: Bootstrap | None = None
    # Hints about this request's own prefix (prompt + output), applied when it finishes.
    hints: tuple[Hint, ...] = ()


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
class ReuseReport:
    """How a request used what the host tier and L3 held of its prompt, and the times
    the live cost model predicted for it (``engine/reuse_plan.py``), beside the real ones.

    ``decision``: load, recompute, split, or unpriced (a cost was not known yet: the
    tiers' default, load). Times in seconds: ``predicted_s`` and ``actual_s`` run from
    admission to the first token; ``waited_s`` is the time held for L3 pages before
    admission (``predicted_wait_s`` what the plan expected when it chose to wait);
    ``predicted_load_s``/``predicted_recompute_s`` price the two pure choices at the
    first plan. None where not known.
    """

    decision: str
    cached_tokens: int  # the prompt was computed from here (device hit + loaded)
    loaded_tokens: int  # of them, from the host tier and L3
    recomputed_tokens: int  # held by a tier, computed again
    predicted_s: float | None = None
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None
    predicted_wait_s: float | None = None
    waited_s: float | None = None
    actual_s: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which made
# building the outputs of a 1000-request step cost 5 ms of the output thread's time; with
# slots and plain assignment it is a fifth of that. Nothing mutates an output once built.
@dataclass(slots=True)
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
    # With GenerateRequest.logprobs: one per token of ``token_ids``, and the prompt's
    # (from LogprobParams.input_from) once, in the output that ends its prefill.
    output_logprobs: tuple[TokenLogprob, ...] = ()
    input_logprobs: tuple[TokenLogprob, ...] = ()
    # When finished, for a request the host tier or L3 held part of: what it loaded.
    reuse: ReuseReport | None = None
    # When finished, for a request with hints: their outcomes, in the order given.
    hints: list[HintOutcome] | None = None


def validate_request(request: GenerateRequest, vocab_size: int, max_context_len: int) -> None:
    """Raise RequestError (a 4xx message) for a request this engine cannot run."""
    request.sampling.validate(vocab_size)
    ids = request.input_ids
    if not ids:
        raise RequestError("the prompt is empty")
    # The length first: it is one comparison, and it bounds the per-id scan below to a
    # context's worth (a megabytes-long prompt is refused without a pass over its ids,
    # which runs where the server's event loop runs).
    total = len(ids) + request.sampling.max_new_tokens
    if total > max_context_len:
        raise RequestError(
            f"this model's context is {max_context_len} tokens; the prompt has "
            f"{len(ids)} and max_tokens asks for {request.sampling.max_new_tokens} more "
            f"({total}): shorten the prompt or lower max_tokens"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids out of the vocabulary [0, {vocab_size}): {bad[:8]}")
    if request.logprobs is not None:
        request.logprobs.validate(vocab_size, len(ids))


class EngineProtocol(Protocol):
    """The engine as the HTTP server uses it (in this process, or in its own: EngineClient)."""

    @property
    def model_name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context_len(self) -> int: ...

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

    def clear_storage(self) -> None:
        """Remove every page of the L3 store (when idle); raises StorageError."""
        ...

    def storage_status(self) -> dict[str, Any]: ...
