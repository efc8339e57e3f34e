"""SGLang's request fields: all declared; neutral values accepted; anything else refused by
name. The field lists are SGLang's GenerateReqInput and SamplingParams (API fields), and
what its router adds to OpenAI requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from hicache.server.chat_protocol import ChatCompletionRequest
from hicache.server.generate_protocol import GenerateReqInput, GenerateSamplingParams
from hicache.server.protocol import CompletionRequest, Neutral, StrictModel
from tests.server_fixtures import RunningServer, serve_in_thread

_GENERATE_FIELDS = """
rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes
mm_content_hashes use_audio_in_video video_config sampling_params return_logprob
logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask
return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_top_logprobs_b64 stream
log_metrics return_hidden_states return_routed_experts routed_experts_start_len
return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor
positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key
decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank kv_router_hint
routing_key conversation_id http_worker_ipc background require_reasoning max_thinking_tokens
priority extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids
external_trace_header received_time need_wait_for_mm_inputs num_items_assigned encoder_urls
max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch
images_config multi_item_delimiter_indices cache_salt
"""
_SAMPLING_FIELDS = """
max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty
presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag
ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim custom_params
stream_interval logit_bias sampling_seed
"""
SGLANG_GENERATE_FIELDS = _GENERATE_FIELDS.split()
SGLANG_SAMPLING_FIELDS = _SAMPLING_FIELDS.split()
# What SGLang's router adds to the requests it forwards.
ROUTER_GENERATE = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False,
                   "return_bytes": False, "return_entropy": False}
ROUTER_OPENAI = {"no_stop_trim": False, "skip_special_tokens": True,
                 "return_hidden_states": False}
ROUTER_CHAT = {**ROUTER_OPENAI, "continue_final_message": False, "separate_reasoning": True,
               "stream_reasoning": True}
# What SGLang's benchmark clients send to /generate.
BENCH_GENERATE = {"stream_options": {"include_usage": True}, "lora_path": None,
                  "logprob_start_len": -1, "return_logprob": False,
                  "return_routed_experts": False}

BASE: dict[type[StrictModel], dict[str, Any]] = {
    GenerateReqInput: {"text": "hi"},
    GenerateSamplingParams: {},
    CompletionRequest: {"prompt": "hi"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
}
CANDIDATES: list[Any] = [2, 0.5, "surprise", True, {"a": 1}, ["x"], {"type": "json_object"},
                         "required", {"type": "function", "function": {"name": "f"}}]


def test_every_sglang_field_is_declared() -> None:
    assert set(SGLANG_GENERATE_FIELDS) <= set(GenerateReqInput.model_fields)
    assert set(SGLANG_SAMPLING_FIELDS) <= set(GenerateSamplingParams.model_fields)
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(ROUTER_OPENAI) <= set(model.model_fields)
    assert set(ROUTER_CHAT) <= set(ChatCompletionRequest.model_fields)


def _neutral(model: type[BaseModel], name: str) -> Neutral:
    return next(m for m in model.model_fields[name].metadata if isinstance(m, Neutral))


@pytest.mark.parametrize(
    ("model", "name"),
    [(model, name) for model in BASE for name in model.unsupported_fields()],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_unsupported_field_takes_its_neutral_values_only(
    model: type[StrictModel], name: str
) -> None:
    for value in _neutral(model, name).values:
        model.model_validate({**BASE[model], name: value})
    refused = 0
    for value in CANDIDATES:
        try:
            model.model_validate({**BASE[model], name: value})
        except ValidationError as error:
            messages = [str(e["msg"]) for e in error.errors()]
            if any(f"{name}=" in m and "not supported yet" in m for m in messages):
                refused += 1
    assert refused, f"{model.__name__}.{name} refuses nothing with its own message"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as running:
        yield running


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"text": "hi", **ROUTER_GENERATE, **BENCH_GENERATE, "stream": True,
                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "n": 1,
                                           "top_k": 1 << 30}}),
        ("/generate", {"input_ids": [1, 2, 3], **ROUTER_GENERATE,
                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, **ROUTER_OPENAI}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3, **ROUTER_CHAT}),
    ],
)
def test_what_sglang_clients_and_router_send_is_served(
    server: RunningServer, route: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{server.url}{route}", json=body, timeout=30.0)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/generate", {"text": "hi", "lora_path": "my-adapter"}, "lora_path"),
        ("/generate", {"text": "hi", "return_entropy": True}, "return_entropy"),
        ("/generate", {"text": "hi", "sampling_params": {"min_p": 0.2}}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "return_hidden_states": True},
         "return_hidden_states"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "reasoning_effort": "high"},
         "reasoning_effort"),
    ],
)
def test_a_non_neutral_value_is_a_400_naming_the_field(
    server: RunningServer, route: str, body: dict[str, Any], field: str
) -> None:
    response = httpx.post(f"{server.url}{route}", json=body, timeout=30.0)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(f"{field}=") or f".{field}=" in error["message"]
    assert "not supported yet" in error["message"]
    assert error["param"].endswith(field)
