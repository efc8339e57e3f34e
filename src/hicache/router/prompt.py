"""A proxied request's prompt as the token ids its worker will see, hence its page hashes.

The router hashes the same ids the worker caches: ``input_ids`` when the client
sent them; else the text through the model's tokenizer as the worker does it
(``engine.tokenize`` for a prompt; the chat template through the worker's own
``chat_prompt_ids`` for messages). A batch routes by its first prompt. A body
the worker will refuse anyway (a wrong field, a template error) routes with no
pages, by load alone: the worker's answer is the error the client gets.

Tenants: the body's cache key (``body_cache_key``: ``extra_key``/``cache_salt`` as
the worker reads them, a batch's first) resolved against the caller's identity
(``tenancy.identity``) is the worker's ``extra_key``; the pages hash chained from
that tenant's root digest (``events.hashing.tenant_root_digest``), as the worker's
KV events announce them, so one tenant's pages never score for another's prompt.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.server.chat_prompt import chat_prompt_ids
from hicache.server.chat_protocol import ChatCompletionRequest
from hicache.server.errors import APIError
from hicache.server.protocol import cache_key
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.load import load_tokenizer

logger = logging.getLogger(__name__)


class PromptKind(enum.Enum):
    CHAT = "chat"  # /v1/chat/completions: messages or input_ids
    COMPLETION = "completion"  # /v1/completions: prompt (text, ids, or a batch of one)
    GENERATE = "generate"  # /generate: text or input_ids, one or a batch


def _ids(value: Any) -> list[int] | None:
    """``value`` as token ids, or None when it is not a non-empty list of ints."""
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return value
    return None


def _first(value: Any) -> Any:
    """A batch's first prompt (a list of texts or of id lists); anything else unchanged."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return value[0]
    return value


def prompt_token_ids(
    kind: PromptKind, body: Mapping[str, Any], tokenizer: Tokenizer | None
) -> list[int]:
    """The ids to hash; empty when there are none to be had (see the module doc)."""
    if kind is PromptKind.CHAT:
        ids = _ids(body.get("input_ids"))
        if ids is not None or tokenizer is None:
            return ids or []
        try:
            return chat_prompt_ids(tokenizer, ChatCompletionRequest.model_validate(body))
        except (ValidationError, APIError, ValueError):
            return []
    if kind is PromptKind.COMPLETION:
        prompt = _first(body.get("prompt"))
    else:
        prompt = _first(body.get("input_ids"))
        if prompt is None:
            prompt = _first(body.get("text"))
    ids = _ids(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, str) and prompt and tokenizer is not None:
        try:
            return tokenizer.encode(prompt)  # as the worker's engine.tokenize
        except ValueError:
            return []
    return []


def _first_text(value: Any) -> str | None:
    """A field as the worker reads it for the first prompt: a text, or a batch's first."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, str) else None


def body_cache_key(body: Mapping[str, Any]) -> str | None:
    """The body's cache namespace (``server.protocol.cache_key`` of its ``extra_key`` and
    ``cache_salt``; a batch's first prompt's). A malformed field counts as none: the worker
    refuses that body anyway."""
    return cache_key(_first_text(body.get("extra_key")), _first_text(body.get("cache_salt")))


def body_max_new_tokens(kind: PromptKind, body: Mapping[str, Any]) -> int | None:
    """The most tokens the request may generate, as its body says: /generate's
    ``sampling_params.max_new_tokens`` (a batch's first), the OpenAI routes'
    ``max_completion_tokens`` or ``max_tokens``; None where it says nothing usable."""
    if kind is PromptKind.GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list) and params:
            params = params[0]
        value = params.get("max_new_tokens") if isinstance(params, Mapping) else None
    else:
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def prompt_pages(
    kind: PromptKind, body: Mapping[str, Any], tokenizer: Tokenizer | None, page_size: int,
    tenant: str | None = None,
) -> tuple[list[int], list[int]]:
    """(token ids, their full pages' hashes in ``tenant``'s chain)."""
    ids = prompt_token_ids(kind, body, tokenizer)
    return ids, page_hashes(ids, page_size, tenant_root_digest(tenant))


class PromptTokenizer:
    """The model's tokenizer, loaded once, off the event loop, at the first need: from
    ``--tokenizer``, else the dir the first worker names (``tokenizer_path``, else
    ``model_path``)."""

    def __init__(self, path: str | None = None) -> None:
        self._path = path
        self._tokenizer: Tokenizer | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> Tokenizer | None:
        return self._tokenizer

    async def get(self, worker_paths: Sequence[str | None]) -> Tokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        async with self._lock:
            if self._tokenizer is None:
                path = self._path or next((p for p in worker_paths if p), None)
                self._tokenizer = await run_in_threadpool(load_tokenizer, path)
                logger.info("tokenizer for page hashes: %s (%s)", path or "byte-level",
                            type(self._tokenizer).__name__)
            return self._tokenizer
