"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming follows OpenAI: ``data:`` chunks, then ``data: [DONE]``; with
``stream_options.include_usage`` one more chunk before [DONE] carries the
usage and an empty ``choices``. Usage reports the prompt tokens served from
the cache as ``prompt_tokens_details.cached_tokens`` (every tier together).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.engine.api import GenerateOutput, GenerateRequest
from hicache.server import tokenization
from hicache.server.errors import APIError, error_payload, parse_body
from hicache.server.generation import Generation, start_generation
from hicache.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from hicache.server.sse import DONE, EventStreamResponse, event
from hicache.server.state import ServerState, get_state

router = APIRouter()

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def usage_of(output: GenerateOutput) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        total_tokens=output.prompt_tokens + output.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.cached_tokens.total),
    )


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name, created=state.created,
        max_model_len=state.engine.max_context_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return ModelList(data=[_model_card(get_state(request))]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_model(model_id)
    return _model_card(state).model_dump()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        input_ids = await tokenization.tokenize(state.engine, body.prompt)
    else:
        input_ids = body.prompt
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    rid = f"cmpl-{uuid.uuid4().hex}"
    generation = await start_generation(
        state, GenerateRequest(tuple(input_ids), body.sampling_params(max_tokens), rid=rid)
    )
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(_completion_events(generation, head, body.include_usage))
    done = await generation.collect(request.is_disconnected)
    response = CompletionResponse(
        id=rid, created=created, model=state.served_model_name,
        choices=[CompletionChoice(text=done.text, finish_reason=done.last.finish_reason)],
        usage=usage_of(done.last),
    )
    return JSONResponse(response.model_dump())


async def _completion_events(
    generation: Generation, head: dict[str, Any], include_usage: bool
) -> AsyncGenerator[str, None]:
    try:
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            if output.text or output.finished:
                reason = output.finish_reason if output.finished else None
                choice = {"index": 0, "text": output.text, "logprobs": None,
                          "finish_reason": reason}
                yield event({**head, "choices": [choice]})
            if output.finished and include_usage:
                yield event({**head, "choices": [], "usage": usage_of(output).model_dump()})
        yield DONE
    finally:
        await generation.aclose()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    input_ids = await tokenization.apply_chat_template(state.engine, messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:
        # Whatever room the context leaves (at least 1, so that a prompt filling the
        # context is refused by the engine with its message about the context).
        max_tokens = max(1, state.engine.max_context_len - len(input_ids))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await start_generation(
        state, GenerateRequest(tuple(input_ids), body.sampling_params(max_tokens), rid=rid)
    )
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(_chat_events(generation, head, body.include_usage))
    done = await generation.collect(request.is_disconnected)
    response = ChatCompletionResponse(
        id=rid, created=created, model=state.served_model_name,
        choices=[ChatChoice(message=ChatMessageOut(content=done.text),
                            finish_reason=done.last.finish_reason)],
        usage=usage_of(done.last),
    )
    return JSONResponse(response.model_dump())


async def _chat_events(
    generation: Generation, head: dict[str, Any], include_usage: bool
) -> AsyncGenerator[str, None]:
    def chunk(delta: dict[str, str], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return event({**head, "choices": [choice]})

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            if output.text:
                yield chunk({"content": output.text})
            if output.finished:
                yield chunk({}, output.finish_reason)
                if include_usage:
                    yield event({**head, "choices": [], "usage": usage_of(output).model_dump()})
        yield DONE
    finally:
        await generation.aclose()
