"""``POST /hicache/warm`` (admin key): prefetch given prefixes from L3 into the host tier.

The body names the prefixes as ``input_ids`` (token-id lists) or ``text`` (strings,
tokenized as /generate tokenizes a prompt, no chat template), with an optional
``max_host_fraction`` (the share of the host pool this warm's prefetches may hold;
default ``--warm-host-fraction``) and ``timeout_s`` (how long to wait for them;
default ``DEFAULT_TIMEOUT_S``, at most ``MAX_TIMEOUT_S``). The engine runs the warm as
cache operations on its scheduler thread (``warm_start``, ``warm_step``, ``warm_stop``;
``cache/warm.py``), so it works in process and under the engine process alike.

Invariants:

- a body that is not valid (not a list, empty, ids outside the vocabulary, a prompt
  longer than the context, more than ``MAX_ITEMS`` items, a fraction outside (0, 1])
  is a 400 and nothing is warmed; no L3 attached, or a draining worker, is a 409;
- the answer (200) comes once every prefetch is settled, or at the timeout, when what
  is in flight is settled keeping what landed: one outcome per item, in order;
- nothing is computed and nothing reaches the device: a later request finds the pages
  as an L2 (host) hit.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from hicache.server import tokenization
from hicache.server.admin_api import authorize
from hicache.server.body import parse_body
from hicache.server.errors import APIError
from hicache.server.state import get_state

router = APIRouter()

WARM_ROUTE = "/hicache/warm"
DEFAULT_WARM_HOST_FRACTION = 0.5
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 600.0
# More prefixes than this in one call is a mistake or a flood, not a warm-up list.
MAX_ITEMS = 1024
# How often the endpoint steps the warm: a prefetch that settled is noticed within this.
POLL_S = 0.02


class WarmEngine(Protocol):
    """What the warm uses of the engine (``Engine`` and ``EngineClient`` both have it)."""

    def storage_status(self) -> dict[str, Any]: ...

    def warm_start(
        self, warm_id: str, items: list[list[int]], max_host_fraction: float
    ) -> dict[str, Any]: ...

    def warm_step(self, warm_id: str) -> dict[str, Any]: ...

    def warm_stop(self, warm_id: str) -> dict[str, Any]: ...


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[list[int]] | None = None
    text: list[str] | None = None
    max_host_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0.0, le=MAX_TIMEOUT_S)


def check_fraction(fraction: float) -> float:
    """``--warm-host-fraction``: a share of the host pool, in (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--warm-host-fraction must be in (0, 1], got {fraction}")
    return fraction


def host_fraction(text: str) -> float:
    """The flag's argparse type: a bad value is a usage error naming it."""
    try:
        return check_fraction(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in (0, 1], got {text!r}"
        ) from None


def validate_items(
    body: WarmRequest, vocab_size: int, max_context_len: int
) -> list[list[int] | str]:
    """The body's prefixes (ids or texts); APIError(400) naming what is wrong."""
    if (body.input_ids is None) == (body.text is None):
        raise APIError(400, "give exactly one of input_ids (token-id lists) or text (strings)")
    items: list[list[int] | str] = [
        *(body.input_ids if body.input_ids is not None else body.text or [])
    ]
    param = "input_ids" if body.input_ids is not None else "text"
    if not items:
        raise APIError(400, f"{param} is empty: name at least one prefix to warm", param=param)
    if len(items) > MAX_ITEMS:
        raise APIError(400, f"{len(items)} prefixes: at most {MAX_ITEMS} per call", param=param)
    for index, item in enumerate(items):
        if not item:
            raise APIError(400, f"{param}[{index}] is empty", param=param)
        if isinstance(item, list):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"input_ids[{index}] has token ids out of the vocabulary "
                               f"[0, {vocab_size}): {bad[:8]}", param=param)
            check_length(index, len(item), max_context_len, param)
    return items


def check_length(index: int, length: int, max_context_len: int, param: str) -> None:
    if length > max_context_len:
        raise APIError(400, f"{param}[{index}] is {length} tokens, longer than the context "
                       f"({max_context_len})", param=param)


async def warm(
    engine: WarmEngine, items: list[list[int]], max_host_fraction: float, timeout_s: float,
) -> list[dict[str, Any]]:
    """Warm ``items`` and wait until every prefetch is settled or ``timeout_s`` passed;
    one outcome per item, in order."""
    warm_id = uuid.uuid4().hex
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    progress = await run_in_threadpool(engine.warm_start, warm_id, items, max_host_fraction)
    try:
        while not progress["done"]:
            if loop.time() >= deadline:
                progress = await run_in_threadpool(engine.warm_stop, warm_id)
                break
            await asyncio.sleep(POLL_S)
            progress = await run_in_threadpool(engine.warm_step, warm_id)
    except BaseException:  # the client left, or the engine failed: no prefetch outlives it
        if not progress["done"]:
            await asyncio.shield(run_in_threadpool(engine.warm_stop, warm_id))
        raise
    results: list[dict[str, Any]] = progress["results"]
    return results


@router.post(WARM_ROUTE)
async def warm_route(request: Request) -> dict[str, Any]:
    """Prefetch the body's prefixes from L3 into the host tier (see the module docstring)."""
    state = get_state(request)
    authorize(state, request)
    body = await parse_body(request, WarmRequest)
    engine: Any = state.engine  # the engine API has the warm, the protocol does not promise it
    raw = validate_items(body, engine.vocab_size, engine.max_context_len)
    items: list[list[int]] = []
    for index, item in enumerate(raw):
        ids = await tokenization.tokenize(engine, item) if isinstance(item, str) else item
        check_length(index, len(ids), engine.max_context_len, "text")
        items.append(ids)
    if state.draining:  # its host tier is about to go: warming it would only delay the drain
        raise APIError(409, "the worker is draining: warm another worker")
    status = await run_in_threadpool(engine.storage_status)
    if not status.get("attached"):
        raise APIError(409, "no L3 storage backend is attached: there is nothing to warm from")
    fraction = body.max_host_fraction or state.warm_host_fraction
    results = await warm(engine, items, fraction, body.timeout_s)
    state.metrics.observe_warm(results)
    warmed = sum(int(r["tokens"]) for r in results)
    return {"results": results, "tokens": warmed, "max_host_fraction": fraction}
