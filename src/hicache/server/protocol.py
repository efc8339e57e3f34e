"""Request and response bodies shared by the HTTP API, and the OpenAI /v1/completions ones.

Requests are validated strictly: a wrong type is an error, not a coercion
("16" is not an integer), and an unknown field is refused, so a misspelt
parameter never goes silently unused.

Clients and SGLang's router send many fields this server does not implement
(LoRA, logprobs, hidden states, disaggregation ...). Each is declared with the
value(s) that mean "off" (``Neutral``): the neutral value is accepted, any
other is refused with a 400 whose message names the field and says it is not
supported yet. Fields that only label or route a request (``routing_key``,
``no_logs`` ...) are accepted with any value of their type: on one worker they
change nothing. The chat request lives in ``chat_protocol``, SGLang's
/generate in ``generate_protocol``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hicache.engine.api import GrammarSpec, SamplingParams
from hicache.server.hint_protocol import RequestHint
from hicache.server.structured_output import (
    one_grammar,
    response_format_grammar,
    sampling_grammar,
)
from hicache.storage.config import StorageConfig


@dataclass(frozen=True)
class Neutral:
    """Field metadata: the values accepted for a feature this server does not implement."""

    values: tuple[Any, ...]

    def accepts(self, value: Any) -> bool:
        # A batch may give a per-item list: neutral when every item is.
        if isinstance(value, list) and value and not any(_same(value, v) for v in self.values):
            return all(self.accepts(item) for item in value)
        return any(_same(value, v) for v in self.values)

    def describe(self) -> str:
        return " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool)
                           else repr(v) for v in self.values)


def _same(a: Any, b: Any) -> bool:
    # Type-aware: True == 1 and 0 == False in Python, not in JSON.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


OFF = Neutral((None,))
OFF_FALSE = Neutral((False, None))


def neutral(*values: Any) -> Neutral:
    return Neutral(values)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name is None:
            return value
        for meta in cls.model_fields[name].metadata:
            if isinstance(meta, Neutral) and not meta.accepts(value):
                raise ValueError(
                    f"{name}={_short(value)} is not supported yet by this server "
                    f"(accepted: {meta.describe()})"
                )
        return value

    @classmethod
    def unsupported_fields(cls) -> list[str]:
        """The declared fields accepted only at their neutral values (for docs and tests)."""
        return [name for name, field in cls.model_fields.items()
                if any(isinstance(m, Neutral) for m in field.metadata)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def stop_strings(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


def as_tuple(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def cache_key(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's two cache namespaces as one engine key, the request's tenant
    (``tenancy/``): the cache salt names the tenant (so a tenant named by a salt and the
    same one named by an API key are one, and ``DELETE /hicache/tenants/<salt>`` purges
    it), SGLang's extra key alone names one too, and with both the extra key is a
    namespace inside the salt's tenant. Requests differing in either never share KV."""
    if not cache_salt:
        return extra_key or None
    return cache_salt if not extra_key else f"{cache_salt}\x00{extra_key}"


# The most samples of one prompt a request may ask (``n``; each is an engine request).
MAX_CHOICES = 64


# ------------------------------------------------------------------ OpenAI requests
class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: Annotated[bool, OFF_FALSE] = False


class _OpenAISampling(StrictModel):
    """The fields /v1/completions and /v1/chat/completions share, SGLang's extensions included."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (not in the OpenAI API)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    no_stop_trim: bool = False  # extension: keep the stop string / token in the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rid: str | None = None  # extension: the request id (the response's id)
    extra_key: str | None = None  # extension: cache namespace
    cache_salt: str | None = None  # extension: cache namespace
    return_cached_tokens_details: bool = False  # extension: sglext.cached_tokens_details
    # Extension: cache hints about the prompt + output (hint_protocol), applied when the
    # request finishes; outcomes in the response's top-level "hicache_hints".
    hicache_hints: list[RequestHint] | None = None
    # Labels and hints with no effect on one worker.
    session_id: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (SGLang)
    min_tokens: int | None = None  # extension (SGLang): eos and stop tokens masked until
    n: int = 1  # samples of the prompt (choices 0 .. n-1)
    # Extensions (SGLang): what the output must match (structured_output.py), one of them.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Any = None  # JSON text or an object
    # Accepted only at their neutral values (see Neutral).
    min_p: Annotated[float | None, neutral(None, 0, 0.0)] = None
    logit_bias: Annotated[dict[str, float] | None, neutral(None, {})] = None
    stop_regex: Annotated[Any, neutral(None, "", [])] = None
    lora_path: Annotated[Any, neutral(None, "")] = None
    session_params: Annotated[Any, OFF] = None
    custom_logit_processor: Annotated[Any, OFF] = None
    custom_params: Annotated[Any, neutral(None, {})] = None
    custom_labels: Annotated[Any, neutral(None, {})] = None
    images_config: Annotated[Any, OFF] = None
    return_hidden_states: Annotated[Any, OFF_FALSE] = False
    return_routed_experts: Annotated[Any, OFF_FALSE] = False
    routed_experts_start_len: Annotated[Any, neutral(0, None)] = 0
    return_token_ids: Annotated[Any, OFF_FALSE] = False
    return_prompt_token_ids: Annotated[Any, OFF_FALSE] = False
    priority: Annotated[Any, neutral(None, 0)] = None
    ngram_corpus_id: Annotated[Any, OFF] = None
    # Prefill-decode disaggregation (server/bootstrap_fields.py checks them).
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Annotated[Any, neutral(None, 0)] = None
    data_parallel_rank: Annotated[Any, neutral(None, 0)] = None
    disagg_prefill_dp_rank: Annotated[Any, OFF] = None
    store: Annotated[Any, OFF_FALSE] = None
    service_tier: Annotated[Any, neutral(None, "auto", "default")] = None

    _check_stop = field_validator("stop", mode="before")(stop_strings)

    @model_validator(mode="after")
    def _check_stream_options(self) -> _OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        self.grammar()  # its refusals are the request's (a 400)
        return self

    def grammar(self) -> GrammarSpec | None:
        """What the output must match (None: anything); ValueError for a bad request."""
        return sampling_grammar(self.json_schema, self.regex, self.ebnf)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def cache_key(self) -> str | None:
        return cache_key(self.extra_key, self.cache_salt)

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        defaults = SamplingParams()
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            stop=as_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_tokens or 0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            grammar=self.grammar(),
        )


class CompletionRequest(_OpenAISampling):
    # A string or token ids, or (OpenAI's batch form) a list of either: each prompt
    # gets n choices, numbered prompt-major (``prompts``).
    prompt: str | list[int] | list[str | list[int]]
    # The prompt's text before the completion's (and its logprobs, with logprobs).
    echo: bool = False
    # The logprobs of the chosen tokens and of the N most likely at each position.
    logprobs: int | None = None
    best_of: Annotated[int | None, neutral(None, 1)] = None
    suffix: Annotated[str | None, neutral(None, "")] = None
    response_format: Any = None  # text, json_object or json_schema (structured_output.py)

    def grammar(self) -> GrammarSpec | None:
        return one_grammar(super().grammar(), response_format_grammar(self.response_format))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        if isinstance(value, str) or _token_ids(value):
            return value
        if isinstance(value, list) and value and \
                all(isinstance(p, str) or _token_ids(p) for p in value):
            return value[0] if len(value) == 1 else value
        raise ValueError("prompt must be a string or a list of token ids, or a batch: a list "
                         "of either (one per prompt)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one unless the request sent a batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or _token_ids(prompt):
            return [cast("str | list[int]", prompt)]
        return list(cast("list[str | list[int]]", prompt))


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in value)


# ------------------------------------------------------------------ OpenAI responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CachedTokensDetails(BaseModel):
    device: int
    host: int
    storage: int


class SglExt(BaseModel):
    """SGLang's extension object on OpenAI responses (``return_cached_tokens_details``)."""

    cached_tokens_details: CachedTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # see logprobs_format.completion_logprobs
    finish_reason: str | None
    matched_stop: int | str | None = None  # as SGLang: the stop token id or string


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    sglext: SglExt | None = None
    hicache_hints: list[dict[str, Any]] | None = None  # outcomes of the request's hints


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hicache"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------ admin
class StorageBackendRequest(StrictModel):
    backend: str
    extra_config: dict[str, Any] = Field(default_factory=dict)
    prefetch_policy: str = StorageConfig.prefetch_policy.value
