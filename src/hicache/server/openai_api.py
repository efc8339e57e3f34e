"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming follows OpenAI: ``data:`` chunks, then ``data: [DONE]``; with
``stream_options.include_usage`` one more chunk before [DONE] carries the
usage and an empty ``choices``. Usage reports the prompt tokens served from
the cache as ``prompt_tokens_details.cached_tokens`` (every tier together);
``return_cached_tokens_details`` adds SGLang's ``sglext.cached_tokens_details``
(by tier). Choices carry SGLang's ``matched_stop``. A chat request with tools
gets the model's ``<tool_call>`` blocks back as ``tool_calls`` (finish reason
"tool_calls"); streamed, content streams up to the first call and the calls
come in one delta at the end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.engine.api import (
    GenerateOutput,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
    TokenLogprob,
)
from hicache.server import tokenization
from hicache.server.chat_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallOut,
)
from hicache.server.errors import APIError, error_payload, parse_body
from hicache.server.generation import Generation, start_generation
from hicache.server.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
from hicache.server.output_text import OutputText, TextOptions
from hicache.server.protocol import (
    CachedTokensDetails,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SglExt,
    Usage,
)
from hicache.server.sse import DONE, EventStreamResponse, event
from hicache.server.state import ServerState, get_state, last_path_component
from hicache.server.tool_parser import ParsedToolCall, ToolCallStream, parse_tool_calls

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


def sglext_of(output: GenerateOutput) -> SglExt:
    cached = output.cached_tokens
    return SglExt(cached_tokens_details=CachedTokensDetails(
        device=cached.device, host=cached.host, storage=cached.storage
    ))


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name, created=state.created,
        root=last_path_component(state.served_model_name),
        max_model_len=state.engine.max_context_len,
    )


def _output_text(
    state: ServerState, input_ids: list[int], sampling: SamplingParams, options: TextOptions
) -> OutputText:
    tokenizer = state.engine.tokenizer
    return OutputText(tokenizer, input_ids, sampling, options, tokenizer.eos_token_ids)


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
    rid = body.rid or f"cmpl-{uuid.uuid4().hex}"
    sampling = body.sampling_params(max_tokens)
    logprobs = None
    if body.logprobs is not None:
        # Echoed, the prompt's tokens come with their logprobs too (the first has none).
        logprobs = LogprobParams(top_n=body.logprobs, input_from=0 if body.echo else -1)
    generation = await start_generation(
        state, GenerateRequest(tuple(input_ids), sampling, rid=rid, extra_key=body.cache_key,
                               logprobs=logprobs)
    )
    text = _output_text(state, input_ids, sampling,
                        TextOptions(body.skip_special_tokens, body.no_stop_trim))
    echo = ""
    if body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else \
            state.engine.tokenizer.decode(input_ids)
    shaper = _CompletionLogprobs(state, logprobs is not None, len(echo))
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(
            _completion_events(generation, text, head, body.include_usage, echo, shaper)
        )
    done = await generation.collect(request.is_disconnected)
    whole = done.whole()
    text.push(whole)
    response = CompletionResponse(
        id=rid, created=created, model=state.served_model_name,
        choices=[CompletionChoice(text=echo + text.text, finish_reason=whole.finish_reason,
                                  matched_stop=text.matched,
                                  logprobs=shaper.whole(whole) if shaper.enabled else None)],
        usage=usage_of(whole),
        sglext=sglext_of(whole) if body.return_cached_tokens_details else None,
    )
    return JSONResponse(_dump(response))


def _dump(response: CompletionResponse | ChatCompletionResponse) -> dict[str, Any]:
    # sglext is left out when not asked for (the other nulls are OpenAI's).
    return response.model_dump(exclude={"sglext"} if response.sglext is None else None)


class _CompletionLogprobs:
    """A completion's logprobs objects, chunk after chunk: text offsets run on from the
    echoed prompt through every chunk."""

    def __init__(self, state: ServerState, enabled: bool, echo_chars: int) -> None:
        self.enabled = enabled
        self._texts = TokenTexts(state.engine.tokenizer)
        self._echo_chars = echo_chars
        self._offset = 0

    def of(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        shaped = completion_logprobs(entries, self._texts, self._offset)
        if entries:
            self._offset = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
        return shaped

    def prompt(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The echoed prompt's; the output's offsets then start after the echoed text."""
        shaped = self.of(entries)
        self._offset = self._echo_chars
        return shaped

    def whole(self, output: GenerateOutput) -> dict[str, Any]:
        prompt = self.prompt(output.input_logprobs)
        completion = self.of(output.output_logprobs)
        return {key: prompt[key] + completion[key] for key in prompt}


async def _completion_events(
    generation: Generation, text: OutputText, head: dict[str, Any], include_usage: bool,
    echo: str, shaper: _CompletionLogprobs,
) -> AsyncGenerator[str, None]:
    def chunk(delta: str, logprobs: dict[str, Any] | None, reason: str | None) -> str:
        choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": reason,
                  "matched_stop": text.matched}
        return event({**head, "choices": [choice]})

    try:
        echoed = False
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            if echo and not echoed:
                echoed = True
                prompt = shaper.prompt(output.input_logprobs) if shaper.enabled else None
                yield chunk(echo, prompt, None)
            delta = text.push(output)
            if delta or output.finished or (shaper.enabled and output.output_logprobs):
                reason = output.finish_reason if output.finished else None
                logprobs = shaper.of(output.output_logprobs) if shaper.enabled else None
                yield chunk(delta, logprobs, reason)
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
    input_ids = await tokenization.chat_prompt(state.engine.tokenizer, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:
        # Whatever room the context leaves (at least 1, so that a prompt filling the
        # context is refused by the engine with its message about the context).
        max_tokens = max(1, state.engine.max_context_len - len(input_ids))
    rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    sampling = body.sampling_params(max_tokens)
    logprobs = LogprobParams(top_n=body.top_logprobs or 0) if body.logprobs else None
    generation = await start_generation(
        state, GenerateRequest(tuple(input_ids), sampling, rid=rid, extra_key=body.cache_key,
                               logprobs=logprobs)
    )
    texts = TokenTexts(state.engine.tokenizer) if body.logprobs else None
    tools = body.tools_enabled
    # Tool-call tags may be special tokens: kept in the text to be parsed (as SGLang does).
    options = TextOptions(body.skip_special_tokens and not tools, body.no_stop_trim)
    text = _output_text(state, input_ids, sampling, options)
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(
            _chat_events(generation, text, head, body.include_usage, tools, texts)
        )
    done = await generation.collect(request.is_disconnected)
    whole = done.whole()
    text.push(whole)
    content: str | None = text.text
    calls: tuple[ParsedToolCall, ...] = ()
    if tools:
        parsed = parse_tool_calls(text.text)
        content, calls = parsed.content, parsed.tool_calls
    message = ChatMessageOut(content=content, tool_calls=_tool_calls_out(calls) or None)
    response = ChatCompletionResponse(
        id=rid, created=created, model=state.served_model_name,
        choices=[ChatChoice(message=message, finish_reason=_chat_reason(whole, calls),
                            matched_stop=text.matched,
                            logprobs=chat_logprobs(whole.output_logprobs, texts)
                            if texts is not None else None)],
        usage=usage_of(whole),
        sglext=sglext_of(whole) if body.return_cached_tokens_details else None,
    )
    return JSONResponse(_dump(response))


def _tool_calls_out(calls: tuple[ParsedToolCall, ...]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]


def _chat_reason(output: GenerateOutput, calls: tuple[ParsedToolCall, ...]) -> str | None:
    if calls and output.finish_reason == "stop":
        return "tool_calls"
    return output.finish_reason


async def _chat_events(
    generation: Generation, text: OutputText, head: dict[str, Any], include_usage: bool,
    tools: bool, texts: TokenTexts | None,
) -> AsyncGenerator[str, None]:
    def chunk(delta: dict[str, Any], reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                  "matched_stop": text.matched if reason is not None else None}
        return event({**head, "choices": [choice]})

    calls_stream = ToolCallStream() if tools else None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            delta = text.push(output)
            if calls_stream is not None:
                delta = calls_stream.push(delta)
            logprobs = None
            if texts is not None and output.output_logprobs:
                logprobs = chat_logprobs(output.output_logprobs, texts)
            if delta or logprobs is not None:
                yield chunk({"content": delta}, logprobs=logprobs)
            if output.finished:
                calls: tuple[ParsedToolCall, ...] = ()
                if calls_stream is not None:
                    rest, calls = calls_stream.finish()
                    if rest:
                        yield chunk({"content": rest})
                    if calls:
                        yield chunk({"tool_calls": [
                            {"index": i, **call.model_dump()}
                            for i, call in enumerate(_tool_calls_out(calls))
                        ]})
                yield chunk({}, _chat_reason(output, calls))
                if include_usage:
                    yield event({**head, "choices": [], "usage": usage_of(output).model_dump()})
        yield DONE
    finally:
        await generation.aclose()
