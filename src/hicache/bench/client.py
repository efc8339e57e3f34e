"""The benchmarks' HTTP client: one streamed request at a time, timed chunk by chunk.

Two API styles:
- ``openai``: ``POST /v1/completions`` with ``stream`` and ``stream_options.include_usage``;
  prompt tokens, completion tokens and ``prompt_tokens_details.cached_tokens`` come
  from the final usage chunk. With ``return_token_ids`` (a vLLM extension) each chunk
  also carries the ids of the tokens it brings (``choices[].token_ids``): they are the
  answer's ids, and a chunk with ids counts as output even when its text is empty (a
  token that ends inside a multi-byte character), as /generate chunks do.
- ``generate``: SGLang's ``POST /generate``; every chunk carries ``meta_info`` with
  ``completion_tokens`` and ``cached_tokens`` (by tier in ``cached_tokens_details``).
  Servers stream ``text``/``output_ids`` either cumulatively (SGLang's default)
  or as increments; the parser tells them apart by comparing the ids it got with
  the completion count the server reports.

Timing is honest: the clock starts just before the request is sent; TTFT is the
time to the first chunk that carries output (text, or new tokens where the API
counts them), not to a role or keep-alive chunk. When no chunk shows output
before the stream ends (an OpenAI server whose tokens decode to no text, as a
dummy model's may), TTFT is the time to the end and ``ttft_from_content`` says
so. Inter-token latency is the gap between output-carrying chunks, spread evenly
over the tokens a chunk brings. Output tokens are the server's count of tokens
generated and streamed, or the number of output chunks when it gives none.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp

from hicache.bench.workload import Prompt

TIERS = ("device", "host", "storage")


class ApiStyle(str, Enum):
    OPENAI = "openai"
    GENERATE = "generate"


@dataclass
class RequestResult:
    """What one request did, as seen by the client (times in seconds)."""

    ok: bool
    sent_at: float  # time.perf_counter() when the request was sent
    latency_s: float  # to the end of the stream
    ttft_s: float | None = None  # None only when the request failed
    ttft_from_content: bool = True
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # as the server counted them
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    cached_by_tier: dict[str, int] | None = None
    text: str = ""
    output_ids: list[int] | None = None
    finish_reason: str | None = None
    chunks: int = 0
    error: str | None = None
    # The outcomes of the request's own cache hints (hicache_hints), as the server gave them.
    hints: list[dict[str, Any]] | None = None
    # /generate only: the server's own time from the request's arrival to its first token
    # (``meta_info.ttft``), and its load-or-recompute report (``meta_info.reuse``: the time
    # held for L3 pages, admission to first token, predicted beside them). The client's
    # TTFT less the server's is what lies between them (a router, the network).
    server_ttft_s: float | None = None
    reuse: dict[str, Any] | None = None
    rid: str | None = None  # /generate: the request id the client gave it


# ------------------------------------------------------------------------ stream parsing
class _Stream:
    """Accumulates the chunks of one response; subclasses read one API style."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.output_chunks = 0
        self.text = ""
        self.output_ids: list[int] | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.cached_by_tier: dict[str, int] | None = None
        self.finish_reason: str | None = None
        self.hints: list[dict[str, Any]] | None = None
        self.server_ttft_s: float | None = None
        self.reuse: dict[str, Any] | None = None
        self.error: str | None = None

    def feed(self, event: dict[str, Any], now: float) -> None:
        self.chunks += 1
        if "error" in event:
            self.error = _error_message(event)
            return
        self._feed(event, now)

    def _feed(self, event: dict[str, Any], now: float) -> None:
        raise NotImplementedError

    def _output(self, num_tokens: int, now: float) -> None:
        """A chunk brought ``num_tokens`` (>= 1) output tokens at ``now``."""
        self.output_chunks += 1
        if self.last_output_at is None:
            self.first_output_at = now
        else:
            gap = (now - self.last_output_at) / num_tokens
            self.itl.extend([gap] * num_tokens)
        self.last_output_at = now

    def result(self, ended_at: float, done: bool) -> RequestResult:
        """The request's outcome; ``done``: the stream ended with [DONE].

        A finish reason also ends a response, for servers that send no [DONE].
        """
        error = self.error
        if error is None and not (done or self.finished):
            error = "the stream ended before the response was complete"
        ok = error is None
        ttft: float | None = None
        from_content = self.first_output_at is not None
        if self.first_output_at is not None:
            ttft = self.first_output_at - self.sent_at
        elif ok:
            ttft = ended_at - self.sent_at
        output_tokens = (
            self.completion_tokens if self.completion_tokens is not None else self.output_chunks
        )
        return RequestResult(
            ok=ok, sent_at=self.sent_at, latency_s=ended_at - self.sent_at, ttft_s=ttft,
            ttft_from_content=from_content, itl_s=self.itl, prompt_tokens=self.prompt_tokens,
            output_tokens=output_tokens, cached_tokens=self.cached_tokens,
            cached_by_tier=self.cached_by_tier, text=self.text, output_ids=self.output_ids,
            finish_reason=self.finish_reason, chunks=self.chunks, error=error, hints=self.hints,
            server_ttft_s=self.server_ttft_s, reuse=self.reuse,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OpenAIStream(_Stream):
    """``/v1/completions`` (``choices[].text``) or chat (``choices[].delta.content``) chunks."""

    def _feed(self, event: dict[str, Any], now: float) -> None:
        choices = event.get("choices") or []
        if choices:
            choice = choices[0]
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.text += piece
            ids = choice.get("token_ids")
            if isinstance(ids, list) and ids:
                self.output_ids = [*(self.output_ids or []), *(int(i) for i in ids)]
                self._output(len(ids), now)
            elif piece:
                self._output(1, now)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        hints = event.get("hicache_hints")
        if isinstance(hints, list):
            self.hints = [h for h in hints if isinstance(h, dict)]
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = _int_or(usage.get("prompt_tokens"), self.prompt_tokens)
            self.completion_tokens = _int_or(
                usage.get("completion_tokens"), self.completion_tokens
            )
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = _int_or(details.get("cached_tokens"), self.cached_tokens)
            # Not in the OpenAI API; read when a server adds it.
            by_tier = details.get("cached_tokens_details")
            if isinstance(by_tier, dict):
                self.cached_by_tier = _tiers(by_tier)


class GenerateStream(_Stream):
    """SGLang ``/generate`` chunks: ``text``, ``output_ids``, ``meta_info``."""

    def __init__(self, sent_at: float) -> None:
        super().__init__(sent_at)
        self._ids: list[int] = []
        self._have_ids = False
        self._count = 0  # output tokens seen so far

    def _feed(self, event: dict[str, Any], now: float) -> None:
        meta = event.get("meta_info") or {}
        reported = meta.get("completion_tokens")
        ids = event.get("output_ids")
        text = event.get("text")
        cumulative = self._is_cumulative(ids, text, reported)
        if ids is not None:
            self._have_ids = True
            self._ids = list(ids) if cumulative else self._ids + list(ids)
        new_text = ""
        if isinstance(text, str):
            new_text = text[len(self.text) :] if cumulative else text
            self.text += new_text
        if isinstance(reported, int):
            count = reported
        elif self._have_ids:
            count = len(self._ids)
        else:
            count = self._count + (1 if new_text else 0)  # no counts at all: a chunk a token
        if count > self._count:
            self._output(count - self._count, now)
            self._count = count
        elif new_text:
            # Text while the count stands still (a server that counts late): still output.
            self._output(1, now)
        self.prompt_tokens = _int_or(meta.get("prompt_tokens"), self.prompt_tokens)
        if isinstance(reported, int):
            self.completion_tokens = reported
        self.cached_tokens = _int_or(meta.get("cached_tokens"), self.cached_tokens)
        details = meta.get("cached_tokens_details")
        if isinstance(details, dict):
            self.cached_by_tier = _tiers(details)
        hints = meta.get("hints")
        if isinstance(hints, list):
            self.hints = [h for h in hints if isinstance(h, dict)]
        ttft = meta.get("ttft")
        if isinstance(ttft, (int, float)) and not isinstance(ttft, bool) and ttft >= 0:
            self.server_ttft_s = float(ttft)
        reuse = meta.get("reuse")
        if isinstance(reuse, dict):
            self.reuse = reuse
        reason = meta.get("finish_reason")
        if reason:
            self.finish_reason = str(reason.get("type")) if isinstance(reason, dict) else str(
                reason
            )
        if self._have_ids:
            self.output_ids = list(self._ids)

    def _is_cumulative(self, ids: Any, text: Any, reported: Any) -> bool:
        if isinstance(ids, list) and isinstance(reported, int):
            return len(ids) == reported
        if isinstance(text, str):
            # Without ids: cumulative text repeats what came before.
            return bool(self.text) and text.startswith(self.text)
        return False


def _tiers(details: dict[str, Any]) -> dict[str, int]:
    return {tier: int(details.get(tier) or 0) for tier in TIERS}


def _int_or(value: Any, default: int | None) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (
        default
    )


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str, float]]:
    """``data:`` payloads of a server-sent-event stream, each with its arrival time."""
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        # LLM servers send each event as one data line: yield it at once rather than at the
        # blank line that ends the event, so the timestamp is the line's arrival.
        if line.startswith("data:"):
            yield line[5:].lstrip(" "), time.perf_counter()
        # Comments (":"), "event:"/"id:" fields and blank separators carry no payload.


# ------------------------------------------------------------------------ client
class BenchClient:
    """Streams requests to one server; use as ``async with BenchClient(...) as client``."""

    def __init__(
        self, base_url: str, api: ApiStyle = ApiStyle.OPENAI, *, model: str | None = None,
        temperature: float = 0.0, ignore_eos: bool = True, timeout_s: float = 600.0,
        max_connections: int = 0, return_token_ids: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api = ApiStyle(api)
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        # OpenAI API only: ask for the output token ids (vLLM's return_token_ids).
        self.return_token_ids = return_token_ids
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BenchClient:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            trust_env=False,  # a benchmark talks to the server directly, never via a proxy
            # Cumulative /generate chunks repeat every output id so far: allow long lines.
            read_bufsize=1 << 20,
        )
        if self.api is ApiStyle.OPENAI and self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("BenchClient is used outside 'async with'")
        return self._session

    async def _first_model(self) -> str:
        """The first model /v1/models lists; "default" when the server has no such route."""
        try:
            async with self.session.get(f"{self.base_url}/v1/models") as resp:
                if resp.status == 200:
                    models = (await resp.json()).get("data") or []
                    if models and models[0].get("id"):
                        return str(models[0]["id"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        return "default"

    def payload(
        self, prompt: Prompt, max_tokens: int, extra: Mapping[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The route and JSON body for one streamed request; ``extra``'s fields are added
        to the body as they are (e.g. ``hicache_hints``)."""
        route, body = self._payload(prompt, max_tokens)
        return route, {**body, **(extra or {})}

    def _payload(self, prompt: Prompt, max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.api is ApiStyle.OPENAI:
            body: dict[str, Any] = {
                "model": self.model or "default",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": self.temperature,
                "ignore_eos": self.ignore_eos,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if self.return_token_ids:
                body["return_token_ids"] = True
            return "/v1/completions", body
        key = "text" if isinstance(prompt, str) else "input_ids"
        return "/generate", {
            key: prompt,
            "sampling_params": {
                "max_new_tokens": max_tokens,
                "temperature": self.temperature,
                "ignore_eos": self.ignore_eos,
            },
            "stream": True,
        }

    async def send(
        self, prompt: Prompt, max_tokens: int, extra: Mapping[str, Any] | None = None,
    ) -> RequestResult:
        """Send one streamed request and time it; never raises for server or network errors.
        ``extra``: more body fields (see ``payload``)."""
        route, body = self.payload(prompt, max_tokens, extra)
        rid = None
        if self.api is ApiStyle.GENERATE and "rid" not in body:
            # Its own id, so that what a router and the worker logged of it can be found.
            rid = body["rid"] = uuid.uuid4().hex
        sent_at = time.perf_counter()
        stream: _Stream = (
            OpenAIStream(sent_at) if self.api is ApiStyle.OPENAI else GenerateStream(sent_at)
        )
        done = False
        try:
            async with self.session.post(f"{self.base_url}{route}", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        message = _error_message(json.loads(text))
                    except ValueError:
                        message = text[:500]
                    stream.error = f"HTTP {resp.status}: {message}"
                else:
                    async for data, now in _sse_events(resp.content):
                        if data == "[DONE]":
                            done = True
                            break
                        try:
                            event = json.loads(data)
                        except ValueError:
                            stream.error = f"unreadable chunk: {data[:200]!r}"
                            break
                        stream.feed(event, now)
                        if stream.error is not None:
                            break
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            # ValueError: a line too long for the reader, or bytes that are not UTF-8.
            stream.error = f"{type(error).__name__}: {error}"
        result = stream.result(time.perf_counter(), done)
        result.rid = rid
        return result

    async def flush_cache(self) -> bool:
        """POST /flush_cache; True when the server says it flushed."""
        try:
            async with self.session.post(f"{self.base_url}/flush_cache") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
