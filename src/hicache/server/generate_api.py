"""SGLang-style POST /generate: text or token ids in; text, token ids and cache details out.

``meta_info.cached_tokens_details`` splits the reused prompt tokens by the
tier they came from (device, host, storage) — the route to watch when
checking the hierarchical cache. As in SGLang, each streamed chunk carries
the whole text and token ids so far (not a delta) and its meta_info;
``finish_reason`` is null until the last chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.engine.api import GenerateOutput, GenerateRequest
from hicache.server import tokenization
from hicache.server.errors import APIError, error_payload, parse_body
from hicache.server.generation import Generation, start_generation
from hicache.server.protocol import (
    CachedTokensDetails,
    GenerateMetaInfo,
    GenerateReqInput,
    GenerateResponse,
)
from hicache.server.sse import DONE, EventStreamResponse, event
from hicache.server.state import get_state

router = APIRouter()


def meta_info(rid: str, output: GenerateOutput, started: float) -> GenerateMetaInfo:
    cached = output.cached_tokens
    latency = output.latency_s if output.latency_s is not None else time.monotonic() - started
    return GenerateMetaInfo(
        id=rid,
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        cached_tokens=cached.total,
        cached_tokens_details=CachedTokensDetails(
            device=cached.device, host=cached.host, storage=cached.storage
        ),
        finish_reason=output.finish_reason if output.finished else None,
        e2e_latency=latency,
        ttft=output.ttft_s,
    )


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, GenerateReqInput)
    if body.text is not None:
        if not body.text:
            raise APIError(400, "the prompt is empty", param="text")
        input_ids = await tokenization.tokenize(state.engine, body.text)
    else:
        assert body.input_ids is not None  # the model checks exactly one is given
        input_ids = body.input_ids
    rid = uuid.uuid4().hex
    generation = await start_generation(
        state, GenerateRequest(tuple(input_ids), body.sampling_params.to_engine(), rid=rid)
    )
    if body.stream:
        return EventStreamResponse(_events(generation, rid))
    done = await generation.collect(request.is_disconnected)
    response = GenerateResponse(
        text=done.text, output_ids=list(done.token_ids),
        meta_info=meta_info(rid, done.last, generation.started),
    )
    return JSONResponse(response.model_dump())


async def _events(generation: Generation, rid: str) -> AsyncGenerator[str, None]:
    text = ""
    token_ids: list[int] = []
    try:
        async for output in generation:
            if output.error is not None:
                yield event(error_payload(500, f"the engine failed the request: {output.error}"))
                break
            text += output.text
            token_ids.extend(output.token_ids)
            body = GenerateResponse(
                text=text, output_ids=token_ids,
                meta_info=meta_info(rid, output, generation.started),
            )
            yield event(body.model_dump())
        yield DONE
    finally:
        await generation.aclose()
