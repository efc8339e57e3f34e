"""SGLang's POST /generate bodies: ``GenerateReqInput`` with its ``SamplingParams``, and
the response with ``meta_info``.

Every field of SGLang's request is declared (so that SGLang's clients, benchmarks
and router work unchanged); what this server does not implement is accepted at
its neutral value only (``Neutral``, see ``protocol``). A request is one prompt
(``text`` a string, ``input_ids`` a list of ids) or a batch (a list of strings,
a list of id lists); per-item fields (``rid``, ``sampling_params``,
``extra_key``) may then be lists of the batch's length. ``hicache_hints`` (pin, retain,
... the request's own prompt and output: ``hint_protocol``) apply to every prompt of a
batch; their outcomes come back in ``meta_info.hints``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from hicache.engine.api import LogprobParams, SamplingParams
from hicache.server.hint_protocol import RequestHint
from hicache.server.protocol import (
    OFF,
    OFF_FALSE,
    CachedTokensDetails,
    StrictModel,
    as_tuple,
    cache_key,
    neutral,
    stop_strings,
)
from hicache.server.structured_output import sampling_grammar


class GenerateSamplingParams(StrictModel):
    # None: the rest of the context (SGLang's meaning).
    max_new_tokens: int | None = SamplingParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k  # -1, 0 or anything past the vocabulary: all tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int | None = 0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    n: int | None = 1  # samples of the prompt (a list of n results)
    # What the output must match (structured_output.py), one of them.
    json_schema: Any = None  # JSON text (SGLang's form) or an object
    regex: str | None = None
    ebnf: str | None = None
    # Accepted only at their neutral values (see Neutral).
    min_p: Annotated[float | None, neutral(0, 0.0, None)] = 0.0
    stop_regex: Annotated[Any, neutral(None, "", [])] = None
    structural_tag: Annotated[Any, OFF] = None
    spaces_between_special_tokens: Annotated[Any, neutral(True, None)] = True
    custom_params: Annotated[Any, neutral(None, {})] = None
    stream_interval: Annotated[Any, neutral(None, 1)] = None
    logit_bias: Annotated[Any, neutral(None, {})] = None

    _check_stop = field_validator("stop", mode="before")(stop_strings)

    @model_validator(mode="after")
    def _one_seed(self) -> GenerateSamplingParams:
        if self.seed is not None and self.sampling_seed not in (None, self.seed):
            raise ValueError("seed and sampling_seed disagree: give one of them")
        sampling_grammar(self.json_schema, self.regex, self.ebnf)  # its refusals: a 400
        return self

    def to_engine(self, max_new_tokens: int) -> SamplingParams:
        """The engine's parameters; ``max_new_tokens`` is the resolved limit."""
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=as_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed if self.seed is not None else self.sampling_seed,
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_new_tokens or 0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            grammar=sampling_grammar(self.json_schema, self.regex, self.ebnf),
        )


def _batch_kind(value: Any) -> str:
    """Which form a one-or-many field has: a list of items (strings, objects, id
    lists) is a batch; anything else, a list of ids included, is one item."""
    many = isinstance(value, list) and bool(value) and isinstance(value[0], str | dict | list)
    return BATCH_TAG if many else ONE_TAG


# Union branch tags; errors.describe_validation_error leaves "~" tags out of field paths.
ONE_TAG, BATCH_TAG = "~one", "~batch"
_FORM = Discriminator(_batch_kind)
OneText = Annotated[Annotated[str, Tag(ONE_TAG)] | Annotated[list[str], Tag(BATCH_TAG)], _FORM]
OneIds = Annotated[
    Annotated[list[int], Tag(ONE_TAG)] | Annotated[list[list[int]], Tag(BATCH_TAG)], _FORM
]
OneSampling = Annotated[
    Annotated[GenerateSamplingParams, Tag(ONE_TAG)]
    | Annotated[list[GenerateSamplingParams], Tag(BATCH_TAG)],
    _FORM,
]


def _per_item(value: Any, index: int) -> Any:
    return value[index] if isinstance(value, list) else value


class GenerateReqInput(StrictModel):
    text: OneText | None = None
    input_ids: OneIds | None = None
    sampling_params: OneSampling = Field(default_factory=GenerateSamplingParams)
    # The request id(s): echoed as meta_info.id. One string for a batch is a prefix
    # (``<rid>_<i>``), as in SGLang.
    rid: OneText | None = None
    stream: bool = False
    extra_key: OneText | None = None
    cache_salt: OneText | None = None
    log_metrics: bool = True  # False: left out of the server's latency histograms
    model: str | None = None  # SGLang's router adds it (null); checked like OpenAI's
    # Log probabilities (meta_info's *_logprobs; see logprobs_format), per prompt or one
    # for all; logprob_start_len -1: output logprobs only.
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    # Labels, hints and switches with no effect on one worker.
    no_logs: bool = False
    session_id: str | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    kv_router_hint: dict[str, Any] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    stream_options: dict[str, Any] | None = None
    # Cache hints about this request's prompt + output, applied when it finishes.
    hicache_hints: list[RequestHint] | None = None
    # Accepted only at their neutral values (see Neutral).
    return_sampling_mask: Annotated[Any, OFF_FALSE] = None
    return_flat_raw_top_logprobs: Annotated[Any, OFF_FALSE] = False
    return_flat_raw_top_logprobs_b64: Annotated[Any, OFF_FALSE] = False
    return_hidden_states: Annotated[Any, OFF_FALSE] = False
    return_routed_experts: Annotated[Any, OFF_FALSE] = False
    routed_experts_start_len: Annotated[Any, neutral(0, None)] = 0
    return_indexer_topk: Annotated[Any, OFF_FALSE] = False
    return_bytes: Annotated[Any, OFF_FALSE] = False
    return_entropy: Annotated[Any, OFF_FALSE] = False
    return_prompt_token_ids: Annotated[Any, OFF_FALSE] = False
    input_embeds: Annotated[Any, OFF] = None
    image_data: Annotated[Any, neutral(None, [])] = None
    video_data: Annotated[Any, neutral(None, [])] = None
    audio_data: Annotated[Any, neutral(None, [])] = None
    mm_hashes: Annotated[Any, OFF] = None
    mm_content_hashes: Annotated[Any, OFF] = None
    use_audio_in_video: Annotated[Any, OFF_FALSE] = False
    video_config: Annotated[Any, OFF] = None
    modalities: Annotated[Any, neutral(None, [])] = None
    session_params: Annotated[Any, OFF] = None
    lora_path: Annotated[Any, neutral(None, "")] = None
    lora_id: Annotated[Any, neutral(None, "")] = None
    custom_logit_processor: Annotated[Any, OFF] = None
    positional_embed_overrides: Annotated[Any, OFF] = None
    # Prefill-decode disaggregation, one or one per item (server/bootstrap_fields.py).
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Annotated[Any, OFF] = None
    decode_tp_size: Annotated[Any, OFF] = None
    routed_dp_rank: Annotated[Any, neutral(None, 0)] = None
    data_parallel_rank: Annotated[Any, neutral(None, 0)] = None
    disagg_prefill_dp_rank: Annotated[Any, OFF] = None
    http_worker_ipc: Annotated[Any, OFF] = None
    background: Annotated[Any, OFF_FALSE] = False
    require_reasoning: Annotated[Any, OFF_FALSE] = False
    max_thinking_tokens: Annotated[Any, OFF] = None
    priority: Annotated[Any, neutral(None, 0)] = None
    custom_labels: Annotated[Any, neutral(None, {})] = None
    need_wait_for_mm_inputs: Annotated[Any, OFF_FALSE] = None
    num_items_assigned: Annotated[Any, OFF] = None
    encoder_urls: Annotated[Any, OFF] = None
    max_dynamic_patch: Annotated[Any, OFF] = None
    min_dynamic_patch: Annotated[Any, OFF] = None
    image_max_dynamic_patch: Annotated[Any, OFF] = None
    video_max_dynamic_patch: Annotated[Any, OFF] = None
    images_config: Annotated[Any, OFF] = None
    multi_item_delimiter_indices: Annotated[Any, OFF] = None

    @model_validator(mode="after")
    def _check_batch(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if not self.is_batch:
            for name in ("rid", "extra_key", "cache_salt", "return_logprob",
                         "logprob_start_len", "top_logprobs_num"):
                if isinstance(getattr(self, name), list):
                    raise ValueError(f"{name} is a list: that needs a batch of prompts")
            if isinstance(self.sampling_params, list):
                raise ValueError("sampling_params is a list: that needs a batch of prompts")
            return self
        size = self.batch_size
        if size == 0:
            raise ValueError("the batch is empty: give at least one prompt")
        for name in ("rid", "extra_key", "cache_salt", "sampling_params", "return_logprob",
                     "logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != size:
                raise ValueError(f"{name} has {len(value)} items for a batch of {size} prompts")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise ValueError("rid: the request ids of a batch must be different")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        # A list of id lists (an empty list is one empty prompt, refused later).
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def batch_size(self) -> int:
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch and prompts is not None else 1

    def item_rid(self, index: int) -> str | None:
        if isinstance(self.rid, str) and self.is_batch:
            return f"{self.rid}_{index}"
        return _per_item(self.rid, index)  # type: ignore[no-any-return]

    def item_sampling(self, index: int) -> GenerateSamplingParams:
        return _per_item(self.sampling_params, index)  # type: ignore[no-any-return]

    def item_logprobs(self, index: int) -> LogprobParams | None:
        if not _per_item(self.return_logprob, index):
            return None
        start = _per_item(self.logprob_start_len, index)
        top = _per_item(self.top_logprobs_num, index)
        ids = self.token_ids_logprob
        if ids and isinstance(ids[0], list):
            ids = ids[index]
        return LogprobParams(
            top_n=top or 0, token_ids=tuple(ids or ()),  # type: ignore[arg-type]
            input_from=-1 if start is None else start,
        )

    def item_bootstrap(self, index: int) -> tuple[Any, Any, Any]:
        """The item's (bootstrap_host, bootstrap_port, bootstrap_room), as given."""
        return (_per_item(self.bootstrap_host, index), _per_item(self.bootstrap_port, index),
                _per_item(self.bootstrap_room, index))

    def item_cache_key(self, index: int) -> str | None:
        return cache_key(_per_item(self.extra_key, index), _per_item(self.cache_salt, index))

    def item_prompt(self, index: int) -> str | list[int]:
        if self.text is not None:
            return self.text[index] if isinstance(self.text, list) else self.text
        assert self.input_ids is not None
        return self.input_ids[index] if self.is_batch else self.input_ids  # type: ignore[return-value]


# ------------------------------------------------------------------ responses
class GenerateMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails
    # SGLang's dict: {"type": "length", "length": N}, {"type": "stop", "matched": id or
    # string}, {"type": "abort", "message": ...}; null until the request ends.
    finish_reason: dict[str, Any] | None
    e2e_latency: float
    ttft: float | None = None
    # With return_logprob (see logprobs_format.sglang_fields); left out otherwise.
    input_token_logprobs: list[Any] | None = None
    output_token_logprobs: list[Any] | None = None
    input_top_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None
    input_token_ids_logprobs: list[Any] | None = None
    output_token_ids_logprobs: list[Any] | None = None
    # Where the host tier or L3 held part of the prompt: how much was loaded and how
    # much computed again, with the predicted and actual times (``ReuseReport``).
    reuse: dict[str, Any] | None = None
    # The outcomes of the request's ``hicache_hints`` (``HintOutcome.as_dict``), on the
    # finished result only.
    hints: list[dict[str, Any]] | None = None

    def dump(self) -> dict[str, Any]:
        """As SGLang writes it: the logprob entries only when asked for, ``reuse`` only
        where a choice was made, ``hints`` only where the request gave some."""
        payload = self.model_dump()
        for name in (*LOGPROB_FIELDS, "reuse", "hints"):
            if payload[name] is None:
                del payload[name]
        return payload


LOGPROB_FIELDS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                  "output_top_logprobs", "input_token_ids_logprobs",
                  "output_token_ids_logprobs")


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo

    def dump(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids,
                "meta_info": self.meta_info.dump()}
