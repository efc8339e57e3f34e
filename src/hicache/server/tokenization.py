"""Prompt text to token ids for the routes, on a worker thread instead of the event loop.

Tokenizing a long prompt or rendering a chat template can take a good fraction of
a second (a slow tokenizer, a megabyte of text): on the server's event loop that
would stall every other client's stream and /health with it. The routes await
these instead; exceptions come back unchanged, so a ``RequestError`` is still a
400 through the app's handlers.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from hicache.engine.api import EngineProtocol
from hicache.server.chat_prompt import chat_prompt_ids
from hicache.server.chat_protocol import ChatCompletionRequest
from hicache.tokenizer.base import Tokenizer


async def tokenize(engine: EngineProtocol, text: str) -> list[int]:
    """``engine.tokenize(text)`` off the event loop."""
    return await run_in_threadpool(engine.tokenize, text)


async def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    """A chat request's prompt ids (``chat_prompt_ids``) off the event loop."""
    return await run_in_threadpool(chat_prompt_ids, tokenizer, body)
