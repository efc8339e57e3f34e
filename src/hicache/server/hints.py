"""``POST /hicache/hints``: pin, unpin, retain, prefetch or demote cached prefixes.

The body is ``{"hints": [item, ...]}``, each item a ``HintItem`` (``hint_protocol``):
a kind, the prefix as ``input_ids`` or ``text`` (tokenized as /generate tokenizes a
prompt, no chat template), and per kind a ``ttl_s``, a ``tier``, a ``tenant`` and a
``cache_salt``. The engine applies them as one cache operation on its scheduler thread
(``apply_hints``) and answers one ``HintOutcome`` per item, in order: accepted,
clipped (and by how much), deferred or rejected (and why). The answer is
``{"results": [outcome.as_dict(), ...]}``.

Invariants:

- the body is checked whole before anything is applied: a malformed item (a bad
  field, no prefix or two, ids outside the vocabulary, a prefix longer than the
  context), an empty list or more than ``MAX_ITEMS`` items is a 400 naming ``hints[i]``
  and no hint of the call is applied;
- the route is open as /generate is (hints act on the caller's own prefixes, and a
  pin is bounded by the tenant's and the total budget, never by trust); the admin key
  is not asked for;
- a draining worker answers 409: its host tier is about to go, a hint there is lost.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from hicache.engine.api import Hint, HintOutcome
from hicache.server import tokenization
from hicache.server.body import sized_off_loop, validate_json
from hicache.server.errors import APIError, describe_validation_error
from hicache.server.hint_protocol import MAX_ITEMS, HintItem
from hicache.server.protocol import cache_key
from hicache.server.state import get_state
from hicache.server.tenant import request_caller
from hicache.tenancy.identity import ANONYMOUS, Caller

router = APIRouter()

HINTS_ROUTE = "/hicache/hints"


class HintEngine(Protocol):
    """What the hints use of the engine (``Engine`` and ``EngineClient`` both have it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context_len(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def apply_hints(self, hints: list[Hint]) -> list[HintOutcome]: ...


class HintsRequest(BaseModel):
    # Items are checked one by one (``parse_items``) so that an error names ``hints[i]``.
    model_config = ConfigDict(extra="forbid")

    hints: list[dict[str, Any]]


def parse_items(raw: list[dict[str, Any]]) -> list[HintItem]:
    """The body's items; APIError(400) naming the first bad one."""
    if not raw:
        raise APIError(400, "hints is empty: give at least one hint", param="hints")
    if len(raw) > MAX_ITEMS:
        raise APIError(400, f"{len(raw)} hints: at most {MAX_ITEMS} per call", param="hints")
    items = []
    for index, item in enumerate(raw):
        try:
            items.append(HintItem.model_validate(item))
        except ValidationError as error:
            message, _ = describe_validation_error(error)
            raise APIError(400, f"hints[{index}]: {message}", param=f"hints[{index}]") from None
    return items


def check_ids(index: int, ids: list[int], vocab_size: int, max_context_len: int) -> None:
    """APIError(400) naming ``hints[index]`` for ids the engine cannot hold."""
    where = f"hints[{index}]"
    if len(ids) > max_context_len:
        raise APIError(400, f"{where}: the prefix is {len(ids)} tokens, longer than the "
                       f"context ({max_context_len})", param=where)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{where}: token ids out of the vocabulary [0, {vocab_size}): "
                       f"{bad[:8]}", param=where)


def checked_items(raw: bytes, vocab_size: int, max_context_len: int) -> list[HintItem]:
    """The body's items, each checked, the token-id prefixes too; APIError(400) naming
    the first bad one."""
    items = parse_items(validate_json(HintsRequest, raw).hints)
    for index, item in enumerate(items):
        if item.input_ids is not None:
            check_ids(index, item.input_ids, vocab_size, max_context_len)
    return items


async def engine_hints(
    engine: HintEngine, items: list[HintItem], caller: Caller = ANONYMOUS,
) -> list[Hint]:
    """The items as the engine's hints, texts tokenized (and checked as ids are), each
    in its tenant's namespace (its ``cache_salt`` resolved against ``caller``)."""
    hints = []
    for index, item in enumerate(items):
        if item.text is not None:
            ids = await tokenization.tokenize(engine, item.text)  # type: ignore[arg-type]
            if not ids:
                raise APIError(400, f"hints[{index}]: the text is no tokens",
                               param=f"hints[{index}]")
            check_ids(index, ids, engine.vocab_size, engine.max_context_len)
        else:
            assert item.input_ids is not None
            ids = item.input_ids
        try:
            hints.append(item.to_hint(tuple(ids), caller.tenant(cache_key(None, item.cache_salt)),
                                      caller.identity))
        except ValueError as error:
            raise APIError(400, f"hints[{index}]: {error}", param=f"hints[{index}]") from None
    return hints


@router.post(HINTS_ROUTE)
async def hints_route(request: Request) -> dict[str, Any]:
    """Apply the body's hints (see the module docstring)."""
    state = get_state(request)
    engine: Any = state.engine  # the engine API has the hints, the protocol does not promise it
    raw = await request.body()
    # Off the event loop when large: a call may name a thousand context-long prefixes.
    items = await sized_off_loop(
        len(raw), lambda: checked_items(raw, engine.vocab_size, engine.max_context_len))
    hints = await engine_hints(engine, items, request_caller(request))
    if state.draining:  # its host tier is about to go: a pin or a retain would be lost
        raise APIError(409, "the worker is draining: send hints to another worker")
    outcomes: list[HintOutcome] = await run_in_threadpool(engine.apply_hints, hints)
    return {"results": [outcome.as_dict() for outcome in outcomes]}
