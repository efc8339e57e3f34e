"""SGLang's native utility endpoints beside generation: tokenizer, health, abort.

    POST /tokenize, /v1/tokenize        text (or texts) to token ids
    POST /detokenize, /v1/detokenize    token ids (or lists of them) to text
    GET  /health_generate               healthy when the engine generates a token
    POST /abort_request                 abort one request by rid, or all in flight

Shapes follow SGLang's: a list in gives a list out, an unknown rid aborts nothing
and still answers 200; ``abort_all`` needs the admin key on a server started with
``--admin-api-key``. ``/health_generate`` runs a one-token request (prompt
``[0]``, greedy, left out of the server's request metrics) and answers 503 when no
token comes within ``HEALTH_GENERATE_TIMEOUT_S``; ``/health`` stays the cheap probe
that only says the server is up.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, TypeVar, cast

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.server.admin_api import authorize_if_keyed
from hicache.server.body import parse_body
from hicache.server.errors import APIError
from hicache.server.generation import start_generation
from hicache.server.protocol import StrictModel
from hicache.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

router = APIRouter()

# How long /health_generate waits for its token (SGLang's default health-check timeout).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Sample separator of ``choices``: the engine requests of ``n`` samples are ``<rid>-<i>``.
_SAMPLE_SEPARATOR = "-"


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class AbortRequest(StrictModel):
    rid: str | None = None
    abort_all: bool = False


_Body = TypeVar("_Body", TokenizeRequest, DetokenizeRequest)


async def _for_model(request: Request, kind: type[_Body]) -> tuple[ServerState, _Body]:
    """The server's state and the request's body, which may name the served model only."""
    state = get_state(request)
    body = await parse_body(request, kind)
    state.check_model(body.model)
    return state, body


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state, body = await _for_model(request, TokenizeRequest)
    tokenizer = state.engine.tokenizer
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt

    def encode() -> list[list[int]]:
        return [tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
                for text in texts]

    ids = await run_in_threadpool(encode)
    max_model_len = state.engine.max_context_len
    if isinstance(body.prompt, str):
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": max_model_len}
    return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": max_model_len}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state, body = await _for_model(request, DetokenizeRequest)
    single = not body.tokens or isinstance(body.tokens[0], int)
    lists = [cast(list[int], body.tokens)] if single else cast(list[list[int]], body.tokens)
    vocab = state.engine.vocab_size
    for ids in lists:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of the vocabulary [0, {vocab}): {bad[:8]}",
                           param="tokens")
    tokenizer = state.engine.tokenizer

    def decode() -> list[str]:
        return [tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
                for ids in lists]

    texts = await run_in_threadpool(decode)
    return {"text": texts[0] if single else texts}


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = get_state(request)
    probe = GenerateRequest((0,), SamplingParams(max_new_tokens=1, temperature=0.0),
                            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    try:
        await asyncio.wait_for(_one_token(state, probe), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, APIError) as error:
        why = "no token" if isinstance(error, TimeoutError) else error.message
        logger.error("health check failed: %s within %g s", why, HEALTH_GENERATE_TIMEOUT_S)
        return JSONResponse({"healthy": False, "error": f"{why}"}, status_code=503)
    return JSONResponse({"healthy": True})


async def _one_token(state: ServerState, probe: GenerateRequest) -> None:
    generation = await start_generation(state, probe, log_metrics=False)
    try:
        async for output in generation:
            if output.error is not None:
                raise APIError(503, f"the engine failed the request: {output.error}")
            if output.token_ids or output.finished:
                return
    finally:
        await generation.aclose()


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, AbortRequest)
    if body.abort_all:
        authorize_if_keyed(state, request)  # every client's requests: not for anyone
        targets = list(state.rids_in_flight)
    elif body.rid:
        prefix = body.rid + _SAMPLE_SEPARATOR
        targets = [rid for rid in state.rids_in_flight
                   if rid == body.rid or rid.startswith(prefix)]
    else:
        raise APIError(400, "give the rid of the request to abort, or abort_all: true",
                       param="rid")
    for rid in targets:
        state.engine.abort(rid)
    return Response(status_code=200)
