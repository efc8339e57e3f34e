"""Prompt text to token ids for the routes, on a worker thread instead of the event loop.

Tokenizing a long prompt or rendering a chat template can take a good fraction of
a second (a slow tokenizer, a megabyte of text): on the server's event loop that
would stall every other client's stream and /health with it. The routes await
these instead; exceptions come back unchanged, so a ``RequestError`` is still a
400 through the app's handlers.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from hicache.engine.api import EngineProtocol


async def tokenize(engine: EngineProtocol, text: str) -> list[int]:
    """``engine.tokenize(text)`` off the event loop."""
    return await run_in_threadpool(engine.tokenize, text)


async def apply_chat_template(engine: EngineProtocol, messages: list[dict[str, Any]]) -> list[int]:
    """``engine.apply_chat_template(messages)`` off the event loop."""
    return await run_in_threadpool(engine.apply_chat_template, messages)
