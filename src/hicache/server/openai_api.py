"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming follows OpenAI: ``data:`` chunks, then ``data: [DONE]``; with
``stream_options.include_usage`` one more chunk before [DONE] carries the
usage and an empty ``choices``. Usage reports the prompt tokens served from
the cache as ``prompt_tokens_details.cached_tokens`` (every tier together);
``return_cached_tokens_details`` adds SGLang's ``sglext.cached_tokens_details``
(by tier); streamed, on the chunk that carries a choice's finish reason (each
of n choices its own), with the usage of all the samples on the last of them
when no usage chunk follows (SGLang's ``bench_serving --cache-report`` reads
both from any chunk, and its completions client needs every chunk to have a
choice). Choices carry SGLang's ``matched_stop``. A body's ``hicache_hints`` (hints about
its own prompt + output, ``hint_protocol``) answer in the response's top-level
``hicache_hints``; streamed, on the chunk with the finish reason of the sample that
carried them (the first of each prompt). A chat request with tools
gets the model's ``<tool_call>`` blocks back as ``tool_calls`` (finish reason
"tool_calls"); streamed, content streams up to the first call and the calls
come in one delta at the end.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.engine.api import (
    Bootstrap,
    GenerateOutput,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
    TokenLogprob,
)
from hicache.server import tokenization
from hicache.server.body import parse_body
from hicache.server.bootstrap_fields import request_bootstrap
from hicache.server.chat_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallOut,
)
from hicache.server.choices import merged, sample_requests, start_samples, usage_of_samples
from hicache.server.client_watch import ClientWatch
from hicache.server.errors import APIError, error_payload
from hicache.server.generation import Generation
from hicache.server.hint_protocol import request_hints
from hicache.server.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
from hicache.server.output_text import OutputText, TextOptions
from hicache.server.protocol import (
    CachedTokensDetails,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SglExt,
)
from hicache.server.sse import DONE, EventStreamResponse, event
from hicache.server.state import ServerState, get_state, last_path_component
from hicache.server.tenant import request_caller, request_tenant
from hicache.server.tool_parser import ParsedToolCall, ToolCallStream, parse_tool_calls

router = APIRouter()

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def sglext_of(output: GenerateOutput) -> SglExt:
    cached = output.cached_tokens
    return SglExt(cached_tokens_details=CachedTokensDetails(
        device=cached.device, host=cached.host, storage=cached.storage
    ))


def _bootstrap(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest
) -> Bootstrap | None:
    return request_bootstrap(state, body.bootstrap_host, body.bootstrap_port,
                             body.bootstrap_room)


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
    state.check_model(model_id, strict=True)  # asks whether that model exists here
    return _model_card(state).model_dump()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    prompts = body.prompts()
    prompt_ids = [await _completion_prompt_ids(state, prompt, i if len(prompts) > 1 else None)
                  for i, prompt in enumerate(prompts)]
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    rid = body.rid or f"cmpl-{uuid.uuid4().hex}"
    sampling = body.sampling_params(max_tokens)
    logprobs = None
    if body.logprobs is not None:
        # Echoed, the prompt's tokens come with their logprobs too (the first has none).
        logprobs = LogprobParams(top_n=body.logprobs, input_from=0 if body.echo else -1)
    # A client that leaves while its request is queued drops it there (never prefilled).
    watch = ClientWatch(request.receive)
    # A batch's prompts are engine requests <rid>-<i> (then <rid>-<i>-<j> for n samples),
    # started together; choices are numbered prompt-major, as OpenAI numbers them.
    tenant = request_tenant(request, body.cache_key)
    hints = request_hints(body.hicache_hints, tenant, request_caller(request).identity)
    groups = await _start_prompts(state, [
        sample_requests(GenerateRequest(
            tuple(ids), sampling, rid=rid if len(prompts) == 1 else f"{rid}-{i}",
            extra_key=tenant, logprobs=logprobs, bootstrap=_bootstrap(state, body),
            hints=hints,
        ), body.n) for i, ids in enumerate(prompt_ids)
    ], watch)
    options = TextOptions(body.skip_special_tokens, body.no_stop_trim)
    choices: list[_CompletionChoiceState] = []
    for prompt, ids, generations in zip(prompts, prompt_ids, groups, strict=True):
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)
        for generation in generations:
            choices.append(_CompletionChoiceState(
                len(choices), generation, _output_text(state, ids, sampling, options),
                _CompletionLogprobs(state, logprobs is not None, len(echo)), echo,
            ))
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(_completion_events(
            choices, head, body.include_usage, body.return_cached_tokens_details, body.n
        ))
    wholes = await _collect_all([c.generation for c in choices], watch)
    out = []
    for choice, whole in zip(choices, wholes, strict=True):
        choice.text.push(whole)
        shaper = choice.shaper
        out.append(CompletionChoice(
            index=choice.index, text=choice.echo + choice.text.text,
            finish_reason=whole.finish_reason, matched_stop=choice.text.matched,
            logprobs=shaper.whole(whole) if shaper.enabled else None,
        ))
    response = CompletionResponse(
        id=rid, created=created, model=state.served_model_name, choices=out,
        usage=usage_of_samples(wholes, body.n),
        sglext=_sglext_of_prompts(wholes, body.n) if body.return_cached_tokens_details
        else None,
        hicache_hints=_hint_outcomes(wholes),
    )
    return JSONResponse(_dump(response))


async def _completion_prompt_ids(
    state: ServerState, prompt: str | list[int], index: int | None
) -> list[int]:
    """One prompt's token ids; ``index`` names it in errors when the request sent a batch."""
    if not prompt:
        where = "prompt" if index is None else f"prompt.{index}"
        raise APIError(400, f"the prompt is empty ({where})", param=where)
    if isinstance(prompt, str):
        return await tokenization.tokenize(state.engine, prompt)
    return prompt


async def _start_prompts(
    state: ServerState, groups: list[list[GenerateRequest]], watch: ClientWatch
) -> list[list[Generation]]:
    """Each prompt's samples (``start_samples``), the prompts side by side; if one is
    refused, the others' started generations are closed and its error raised."""
    outcomes = await asyncio.gather(
        *(start_samples(state, group, watch=watch) for group in groups), return_exceptions=True
    )
    started = [o for o in outcomes if not isinstance(o, BaseException)]
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            for generations in started:
                for generation in generations:
                    await generation.aclose()
            raise outcome
    return cast(list[list[Generation]], outcomes)


def _sglext_of_prompts(outputs: Sequence[GenerateOutput], per_prompt: int) -> SglExt:
    """SGLang's cached-token details of a batch: each prompt's (its first sample's), summed."""
    details = [sglext_of(o).cached_tokens_details for o in outputs[::per_prompt]]
    return SglExt(cached_tokens_details=CachedTokensDetails(
        device=sum(d.device for d in details), host=sum(d.host for d in details),
        storage=sum(d.storage for d in details),
    ))


async def _collect_all(
    generations: list[Generation], watch: ClientWatch
) -> list[GenerateOutput]:
    """Every sample to its end, as one output each; a failure (or the client leaving)
    stops the others too."""
    try:
        done = await asyncio.gather(*(g.collect(watch) for g in generations))
    finally:
        for generation in generations:
            await generation.aclose()
    return [d.whole() for d in done]


def _dump(response: CompletionResponse | ChatCompletionResponse) -> dict[str, Any]:
    # sglext and hicache_hints are left out when not asked for (the other nulls are OpenAI's).
    exclude = {name for name in ("sglext", "hicache_hints") if getattr(response, name) is None}
    return response.model_dump(exclude=exclude or None)


def _hint_outcomes(outputs: Sequence[GenerateOutput]) -> list[dict[str, Any]] | None:
    """The outcomes of the request's hicache_hints: those of every output that carried
    hints (the first sample of each prompt), in order; None when it gave none."""
    carried = [o.hints for o in outputs if o.hints is not None]
    if not carried:
        return None
    return [outcome.as_dict() for outcomes in carried for outcome in outcomes]


def _finish_extras(
    output: GenerateOutput, finals: dict[int, GenerateOutput], samples: int,
    with_sglext: bool, include_usage: bool, per_prompt: int | None = None,
) -> dict[str, Any]:
    """What the chunk with a choice's finish reason adds to a stream: that sample's sglext
    when asked for and, once every sample has finished (``finals`` holds them all, this
    one included) and no usage chunk follows, the usage of all of them, so that a cache
    report divides the cached tokens by the prompt tokens the server counted (a chat
    template adds some to the client's)."""
    extras: dict[str, Any] = {}
    if output.hints is not None:  # the request's hint outcomes, on its sample's last chunk
        extras["hicache_hints"] = [outcome.as_dict() for outcome in output.hints]
    if not with_sglext:
        return extras
    extras["sglext"] = sglext_of(output).model_dump()
    if not include_usage and len(finals) == samples:
        extras["usage"] = usage_of_samples(
            [finals[i] for i in range(samples)], per_prompt).model_dump()
    return extras


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


@dataclass
class _CompletionChoiceState:
    index: int
    generation: Generation
    text: OutputText
    shaper: _CompletionLogprobs
    echo: str = ""  # the prompt's text, with echo
    echoed: bool = False


async def _completion_events(
    choices: list[_CompletionChoiceState], head: dict[str, Any], include_usage: bool,
    with_sglext: bool, per_prompt: int,
) -> AsyncGenerator[str, None]:
    def chunk(choice: _CompletionChoiceState, delta: str, logprobs: dict[str, Any] | None,
              reason: str | None, extras: dict[str, Any] | None = None) -> str:
        body = {"index": choice.index, "text": delta, "logprobs": logprobs,
                "finish_reason": reason, "matched_stop": choice.text.matched}
        return event({**head, "choices": [body], **(extras or {})})

    finals: dict[int, GenerateOutput] = {}
    try:
        async for index, output in merged([c.generation for c in choices]):
            choice = choices[index]
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            shaper = choice.shaper
            if choice.echo and not choice.echoed:
                choice.echoed = True
                prompt = shaper.prompt(output.input_logprobs) if shaper.enabled else None
                yield chunk(choice, choice.echo, prompt, None)
            delta = choice.text.push(output)
            if output.finished:
                finals[index] = output
            if delta or output.finished or (shaper.enabled and output.output_logprobs):
                reason = output.finish_reason if output.finished else None
                logprobs = shaper.of(output.output_logprobs) if shaper.enabled else None
                extras = _finish_extras(
                    output, finals, len(choices), with_sglext, include_usage, per_prompt
                ) if output.finished else None
                yield chunk(choice, delta, logprobs, reason, extras)
        if include_usage and len(finals) == len(choices):
            usage = usage_of_samples([finals[i] for i in range(len(choices))], per_prompt)
            yield event({**head, "choices": [], "usage": usage.model_dump()})
        yield DONE
    finally:
        for choice in choices:
            await choice.generation.aclose()


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
    # A client that leaves while its request is queued drops it there (never prefilled).
    watch = ClientWatch(request.receive)
    tenant = request_tenant(request, body.cache_key)
    hints = request_hints(body.hicache_hints, tenant, request_caller(request).identity)
    generations = await start_samples(state, sample_requests(
        GenerateRequest(tuple(input_ids), sampling, rid=rid, extra_key=tenant,
                        logprobs=logprobs, bootstrap=_bootstrap(state, body),
                        hints=hints), body.n,
    ), watch=watch)
    texts = TokenTexts(state.engine.tokenizer) if body.logprobs else None
    tools = body.tools_enabled
    # Tool-call tags may be special tokens: kept in the text to be parsed (as SGLang does).
    options = TextOptions(body.skip_special_tokens and not tools, body.no_stop_trim)
    choices = [
        _ChatChoiceState(i, generation, _output_text(state, input_ids, sampling, options),
                         ToolCallStream() if tools else None)
        for i, generation in enumerate(generations)
    ]
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": state.served_model_name}
    if body.stream:
        return EventStreamResponse(_chat_events(
            choices, head, body.include_usage, texts, body.return_cached_tokens_details
        ))
    wholes = await _collect_all(generations, watch)
    out = []
    for choice, whole in zip(choices, wholes, strict=True):
        text = choice.text
        text.push(whole)
        content: str | None = text.text
        calls: tuple[ParsedToolCall, ...] = ()
        if tools:
            parsed = parse_tool_calls(text.text)
            content, calls = parsed.content, parsed.tool_calls
        message = ChatMessageOut(content=content, tool_calls=_tool_calls_out(calls) or None)
        out.append(ChatChoice(
            index=choice.index, message=message, finish_reason=_chat_reason(whole, calls),
            matched_stop=text.matched,
            logprobs=chat_logprobs(whole.output_logprobs, texts) if texts is not None else None,
        ))
    response = ChatCompletionResponse(
        id=rid, created=created, model=state.served_model_name, choices=out,
        usage=usage_of_samples(wholes),
        sglext=sglext_of(wholes[0]) if body.return_cached_tokens_details else None,
        hicache_hints=_hint_outcomes(wholes),
    )
    return JSONResponse(_dump(response))


@dataclass
class _ChatChoiceState:
    index: int
    generation: Generation
    text: OutputText
    calls_stream: ToolCallStream | None  # with tools


def _tool_calls_out(calls: tuple[ParsedToolCall, ...]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]


def _chat_reason(output: GenerateOutput, calls: tuple[ParsedToolCall, ...]) -> str | None:
    if calls and output.finish_reason == "stop":
        return "tool_calls"
    return output.finish_reason


async def _chat_events(
    choices: list[_ChatChoiceState], head: dict[str, Any], include_usage: bool,
    texts: TokenTexts | None, with_sglext: bool,
) -> AsyncGenerator[str, None]:
    def chunk(choice: _ChatChoiceState, delta: dict[str, Any], reason: str | None = None,
              logprobs: dict[str, Any] | None = None,
              extras: dict[str, Any] | None = None) -> str:
        body = {"index": choice.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": reason,
                "matched_stop": choice.text.matched if reason is not None else None}
        return event({**head, "choices": [body], **(extras or {})})

    finals: dict[int, GenerateOutput] = {}
    try:
        for choice in choices:
            yield chunk(choice, {"role": "assistant", "content": ""})
        async for index, output in merged([c.generation for c in choices]):
            choice = choices[index]
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            delta = choice.text.push(output)
            calls_stream = choice.calls_stream
            if calls_stream is not None:
                delta = calls_stream.push(delta)
            logprobs = None
            if texts is not None and output.output_logprobs:
                logprobs = chat_logprobs(output.output_logprobs, texts)
            if delta or logprobs is not None:
                yield chunk(choice, {"content": delta}, logprobs=logprobs)
            if output.finished:
                finals[index] = output
                calls: tuple[ParsedToolCall, ...] = ()
                if calls_stream is not None:
                    rest, calls = calls_stream.finish()
                    if rest:
                        yield chunk(choice, {"content": rest})
                    if calls:
                        yield chunk(choice, {"tool_calls": [
                            {"index": i, **call.model_dump()}
                            for i, call in enumerate(_tool_calls_out(calls))
                        ]})
                yield chunk(choice, {}, _chat_reason(output, calls), extras=_finish_extras(
                    output, finals, len(choices), with_sglext, include_usage))
        if include_usage and len(finals) == len(choices):
            usage = usage_of_samples([finals[i] for i in range(len(choices))])
            yield event({**head, "choices": [], "usage": usage.model_dump()})
        yield DONE
    finally:
        for choice in choices:
            await choice.generation.aclose()
