"""SGLang-style POST /generate: text or token ids in; text, token ids and cache details out.

``meta_info.cached_tokens_details`` splits the reused prompt tokens by the
tier they came from (device, host, storage) — the route to watch when
checking the hierarchical cache. As in SGLang, each streamed chunk carries
the whole text and token ids so far (not a delta) and its meta_info;
``finish_reason`` is null until the last chunk, then SGLang's dict
(``{"type": "length", "length": N}``, ``{"type": "stop", "matched": ...}``),
and ``ttft`` is there from the first chunk with a token. A batch (a list of
prompts) runs concurrently and answers a JSON list, one result per prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.engine.api import GenerateOutput, GenerateRequest, LogprobParams, TokenLogprob
from hicache.server import tokenization
from hicache.server.body import parse_body
from hicache.server.bootstrap_fields import request_bootstrap
from hicache.server.choices import merged, sample_requests, start_samples
from hicache.server.client_watch import ClientWatch
from hicache.server.errors import APIError, error_payload
from hicache.server.generate_protocol import (
    GenerateMetaInfo,
    GenerateReqInput,
    GenerateResponse,
)
from hicache.server.generation import Generation
from hicache.server.hint_protocol import request_hints
from hicache.server.logprobs_format import TokenTexts, sglang_fields
from hicache.server.output_text import OutputText, TextOptions, finish_reason
from hicache.server.protocol import MAX_CHOICES, CachedTokensDetails
from hicache.server.sse import DONE, EventStreamResponse, event
from hicache.server.state import ServerState, get_state
from hicache.server.tenant import request_caller, request_tenant

router = APIRouter()


@dataclass
class _Running:
    """One prompt of the request, submitted: its id, its stream, its text as asked, and
    its logprobs so far (when asked)."""

    rid: str
    generation: Generation
    text: OutputText
    logprobs: LogprobParams | None = None
    token_texts: TokenTexts | None = None  # return_text_in_logprobs
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)

    def push(self, output: GenerateOutput) -> None:
        self.text.push(output)
        self.input_logprobs.extend(output.input_logprobs)
        self.output_logprobs.extend(output.output_logprobs)

    def response(self, output: GenerateOutput) -> GenerateResponse:
        cached = output.cached_tokens
        generation = self.generation
        latency = (output.latency_s if output.latency_s is not None
                   else time.monotonic() - generation.started)
        meta = GenerateMetaInfo(
            id=self.rid,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            cached_tokens=cached.total,
            cached_tokens_details=CachedTokensDetails(
                device=cached.device, host=cached.host, storage=cached.storage
            ),
            finish_reason=finish_reason(output, self.text.matched),
            e2e_latency=latency,
            ttft=generation.first_token_s,
            reuse=None if output.reuse is None else output.reuse.as_dict(),
            hints=None if output.hints is None else [h.as_dict() for h in output.hints],
        )
        if self.logprobs is not None:
            fields = sglang_fields(self.logprobs, self.input_logprobs, self.output_logprobs,
                                   self.token_texts)
            meta = meta.model_copy(update=fields)
        return GenerateResponse(text=self.text.text, output_ids=list(self.text.token_ids),
                                meta_info=meta)


@router.post("/generate")
@router.put("/generate")  # SGLang answers both
async def generate(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, GenerateReqInput)
    state.check_model(body.model)
    samples = [body.item_sampling(i).n or 1 for i in range(body.batch_size)]
    # The client may leave while its prompts wait in the engine's queue: they are
    # dropped there, never prefilled.
    watch = ClientWatch(request.receive)
    if not body.is_batch and samples[0] == 1:
        running = (await _start(state, request, body, 0, watch))[0]
        if body.stream:
            return EventStreamResponse(_events(running))
        result = await _complete(running, watch)
        return JSONResponse(result.dump())
    # A batch, or n samples of one prompt: a list of results, prompt by prompt and each
    # prompt's samples in order (as SGLang answers); streamed, each chunk names its "index"
    # in that order.
    batch = await _start_batch(state, request, body, watch)
    if body.stream:
        return EventStreamResponse(_batch_events(batch))
    try:
        results = await asyncio.gather(*(_complete(item, watch) for item in batch))
    finally:  # a failed item: the others stop too (they hold pages nobody will read)
        for item in batch:
            await item.generation.aclose()
    return JSONResponse([result.dump() for result in results])


async def _start(
    state: ServerState, request: Request, body: GenerateReqInput, index: int,
    watch: ClientWatch,
) -> list[_Running]:
    """The prompt's samples (one unless ``n``), started (see choices.start_samples)."""
    prompt = body.item_prompt(index)
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="text")
        input_ids = await tokenization.tokenize(state.engine, prompt)
    else:
        input_ids = prompt
    params = body.item_sampling(index)
    max_new_tokens = params.max_new_tokens
    if max_new_tokens is None:  # the rest of the context (at least 1: see chat)
        max_new_tokens = max(1, state.engine.max_context_len - len(input_ids))
    sampling = params.to_engine(max_new_tokens)
    rid = body.item_rid(index) or uuid.uuid4().hex
    logprobs = body.item_logprobs(index)
    tenant = request_tenant(request, body.item_cache_key(index))
    engine_request = GenerateRequest(
        tuple(input_ids), sampling, rid=rid, extra_key=tenant,
        logprobs=logprobs,
        bootstrap=request_bootstrap(state, *body.item_bootstrap(index)),
        hints=request_hints(body.hicache_hints, tenant, request_caller(request).identity),
    )
    if not 1 <= (params.n or 1) <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {params.n}",
                       param="sampling_params.n")
    requests = sample_requests(engine_request, params.n or 1)
    generations = await start_samples(state, requests, log_metrics=body.log_metrics,
                                      watch=watch)
    tokenizer = state.engine.tokenizer
    options = TextOptions(params.skip_special_tokens, params.no_stop_trim)
    texts = TokenTexts(tokenizer) if body.return_text_in_logprobs else None
    return [
        _Running(r.rid, generation,
                 OutputText(tokenizer, input_ids, sampling, options, tokenizer.eos_token_ids),
                 logprobs, texts)
        for r, generation in zip(requests, generations, strict=True)
    ]


async def _start_batch(
    state: ServerState, request: Request, body: GenerateReqInput, watch: ClientWatch
) -> list[_Running]:
    """Submit every prompt at once (each waits for its first token); if one is refused,
    the others are stopped and the error names the refused prompt."""
    outcomes = await asyncio.gather(
        *(_start(state, request, body, i, watch) for i in range(body.batch_size)),
        return_exceptions=True,
    )
    started = [r for o in outcomes if isinstance(o, list) for r in o]
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            for item in started:
                await item.generation.aclose()
            if isinstance(outcome, APIError):
                outcome.message = f"prompt {index} of the batch: {outcome.message}"
            raise outcome
    return started


async def _complete(running: _Running, watch: ClientWatch) -> GenerateResponse:
    done = await running.generation.collect(watch)
    # The whole output at once: the text is decoded (or taken) in one go.
    whole = done.whole()
    running.push(whole)
    return running.response(whole)


async def _batch_events(batch: list[_Running]) -> AsyncGenerator[str, None]:
    """The chunks of every item as they come, each with its item's ``index``."""
    try:
        async for index, output in merged([item.generation for item in batch]):
            if output.error is not None:
                message = f"the engine failed the request: {output.error}"
                yield event({**error_payload(500, message), "index": index})
                break
            running = batch[index]
            running.push(output)
            yield event({**running.response(output).dump(), "index": index})
        yield DONE
    finally:  # merged() closes every generation when it ends or the client goes away
        for item in batch:
            await item.generation.aclose()


async def _events(running: _Running) -> AsyncGenerator[str, None]:
    generation = running.generation
    try:
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            running.push(output)
            payload: dict[str, Any] = running.response(output).dump()
            yield event(payload)
        yield DONE
    finally:
        await generation.aclose()
