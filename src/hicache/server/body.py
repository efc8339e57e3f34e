"""Request bodies to typed requests, with the event loop kept free for everyone else.

The body arrives under ``--max-request-bytes`` (``body_limit``). Parsing it —
JSON decoding, pydantic validation with its Python validators, and for a
refused body the readable message built from every problem — is work that
grows with the body: a few milliseconds for a chat turn, tens to hundreds for
a body of megabytes on a busy machine. Bodies above ``INLINE_BYTES`` are
parsed on a worker thread, so /health and other clients' streams keep being
served meanwhile; small ones inline, where a thread hop would cost more than
the parse. Errors are the same either way: an ``APIError(400)`` whose message
names the offending fields (``errors.describe_validation_error``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from hicache.server.errors import APIError, describe_validation_error

# Bodies up to this size are parsed on the event loop (well under a millisecond).
INLINE_BYTES = 64 * 1024

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


async def sized_off_loop(size: int, work: Callable[[], T]) -> T:
    """``work()``, on a worker thread when ``size`` (the bytes it handles) is large."""
    if size <= INLINE_BYTES:
        return work()
    return await run_in_threadpool(work)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request's JSON body as ``model``; APIError(400) with a readable message if not."""
    raw = await request.body()
    return await sized_off_loop(len(raw), lambda: validate_json(model, raw))


def validate_json(model: type[ModelT], raw: bytes) -> ModelT:
    """``raw`` as ``model``; APIError(400) with a readable message if it is not one."""
    if not raw or raw.isspace():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, param = describe_validation_error(error)
        raise APIError(400, message, param=param) from None
