"""Request and response bodies of the HTTP API (OpenAI-compatible and SGLang-style).

Requests are validated strictly: a wrong type is an error, not a coercion
("16" is not an integer), and an unknown field is refused, so a misspelt
parameter never goes silently unused. Fields that clients commonly send but
the engine does not implement (n, logprobs, penalties ...) are declared and
accept only their neutral value; anything else is refused with a message
that says so. Fields whose JSON type varies (a prompt that is text or token
ids, stop as a string or a list) are checked by validators that name the
accepted forms in their error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hicache.engine.api import SamplingParams
from hicache.storage.config import StorageConfig


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _stop_strings(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


def _unsupported(name: str, value: Any, neutral: tuple[Any, ...]) -> None:
    if value not in neutral:
        raise ValueError(f"{name}={value!r} is not supported by this server")


# ------------------------------------------------------------------ OpenAI requests
class StreamOptions(StrictModel):
    include_usage: bool = False


class _OpenAISampling(StrictModel):
    """The sampling fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (not in the OpenAI API)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Declared so that clients sending their neutral values work; see _check_unsupported.
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    _check_stop = field_validator("stop", mode="before")(_stop_strings)

    @model_validator(mode="after")
    def _check_unsupported(self) -> _OpenAISampling:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: this server returns one choice (n=1)")
        _unsupported("presence_penalty", self.presence_penalty, (None, 0))
        _unsupported("frequency_penalty", self.frequency_penalty, (None, 0))
        _unsupported("logit_bias", self.logit_bias, (None, {}))
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        defaults = SamplingParams()
        stop = self.stop if isinstance(self.stop, list) else [self.stop] if self.stop else []
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_OpenAISampling):
    # A string or token ids; a list holding one of either is accepted too (the
    # OpenAI batch form with a single prompt).
    prompt: str | list[int]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return value
            if len(value) == 1 and isinstance(value[0], str | list):
                return cls._one_prompt(value[0])
            if len(value) > 1 and all(isinstance(p, str | list) for p in value):
                raise ValueError("send one prompt per request (batched prompts are not supported)")
        raise ValueError("prompt must be a string or a list of token ids")

    @model_validator(mode="after")
    def _check_completion_only(self) -> CompletionRequest:
        _unsupported("best_of", self.best_of, (None, 1))
        _unsupported("echo", self.echo, (False,))
        _unsupported("logprobs", self.logprobs, (None, 0))
        _unsupported("suffix", self.suffix, (None, ""))
        return self


class ContentPart(BaseModel):
    # Other part types (images ...) pass validation here and are refused by the
    # chat template with a message naming what is supported.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_form(cls, value: Any) -> Any:
        if value is None or isinstance(value, str | list):
            return value
        raise ValueError("content must be a string or a list of content parts")


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat_only(self) -> ChatCompletionRequest:
        _unsupported("logprobs", self.logprobs, (False,))
        _unsupported("top_logprobs", self.top_logprobs, (None, 0))
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        _unsupported("tool_choice", self.tool_choice, (None, "none"))
        return self


# ------------------------------------------------------------------ OpenAI responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hicache"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------ SGLang-style /generate
class GenerateSamplingParams(StrictModel):
    max_new_tokens: int = SamplingParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    _check_stop = field_validator("stop", mode="before")(_stop_strings)

    def to_engine(self) -> SamplingParams:
        stop = self.stop if isinstance(self.stop, list) else [self.stop] if self.stop else []
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class GenerateReqInput(StrictModel):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        _unsupported("return_logprob", self.return_logprob, (False,))
        return self


class CachedTokensDetails(BaseModel):
    device: int
    host: int
    storage: int


class GenerateMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails
    finish_reason: str | None
    e2e_latency: float
    ttft: float | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


# ------------------------------------------------------------------ admin
class StorageBackendRequest(StrictModel):
    backend: str
    extra_config: dict[str, Any] = Field(default_factory=dict)
    prefetch_policy: str = StorageConfig.prefetch_policy.value
