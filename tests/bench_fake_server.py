"""A stand-in LLM server for client tests: real HTTP on loopback, scripted timing.

It speaks both APIs the benchmarks use (OpenAI /v1/completions with SSE and
usage, SGLang-style /generate with cumulative chunks and meta_info), waits
``ttft_s`` before the first output token and ``itl_s`` between tokens, and
reports as cached the longest prefix a request shares with any earlier prompt
and its answer (all of it on the "device" tier). Output token i is ``65 + i % 26`` ("A", "B",
...). It records what it received and how many requests ran at once, so tests
can check what the client sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class FakeState:
    ttft_s: float = 0.05
    itl_s: float = 0.005
    # /generate: tokens per streamed chunk (SGLang may batch several into one chunk).
    tokens_per_chunk: int = 1
    # OpenAI: send a chunk with empty text before the first token (as role chunks are).
    empty_first_chunk: bool = True
    received: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0
    flushes: int = 0


def _tokens(prompt: Any) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else list(str(prompt).encode("utf-8"))


def _cached(state: FakeState, tokens: list[int]) -> int:
    best = 0
    for old in state.prompts:
        n = 0
        for a, b in zip(old, tokens, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    # Like a real server: at least the last prompt token is computed.
    return min(best, max(0, len(tokens) - 1))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/flush_cache")
    async def flush() -> Response:
        state.prompts.clear()
        state.flushes += 1
        return Response(status_code=200)

    async def run(
        tokens: list[int], max_tokens: int
    ) -> AsyncIterator[tuple[list[int], int]]:
        """Yields (new token ids, cached tokens) on the scripted schedule."""
        cached = _cached(state, tokens)
        state.inflight += 1
        state.max_inflight = max(state.max_inflight, state.inflight)
        output: list[int] = []
        try:
            await asyncio.sleep(state.ttft_s)  # the scripted schedule: time to first token
            while len(output) < max_tokens:
                n = min(state.tokens_per_chunk, max_tokens - len(output))
                if output:
                    await asyncio.sleep(state.itl_s * n)  # and between tokens
                ids = [65 + (len(output) + i) % 26 for i in range(n)]
                output += ids
                yield ids, cached
        finally:
            state.inflight -= 1
            # As a real server, the answer's tokens are cached after the prompt's.
            state.prompts.append(tokens + output)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        state.received.append({"route": "openai", **body})
        max_tokens = int(body.get("max_tokens", 16))
        if max_tokens > 1000:
            return _error(400, f"max_tokens {max_tokens} is too large")
        tokens = _tokens(body["prompt"])
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        # vLLM's extension: every chunk names the ids of the tokens it brings.
        with_ids = bool(body.get("return_token_ids"))

        async def events() -> AsyncIterator[str]:
            head = {"id": "cmpl-1", "object": "text_completion", "model": body.get("model")}
            if state.empty_first_chunk:
                yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": None}]})
            count = 0
            cached = 0
            async for ids, hit in run(tokens, max_tokens):
                cached = hit
                count += len(ids)
                text = bytes(ids).decode()
                reason = "length" if count == max_tokens else None
                choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason}
                if with_ids:
                    choice["token_ids"] = list(ids)
                yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": {
                    "prompt_tokens": len(tokens), "completion_tokens": count,
                    "total_tokens": len(tokens) + count,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        state.received.append({"route": "generate", **body})
        params = body.get("sampling_params") or {}
        max_tokens = int(params.get("max_new_tokens", 16))
        tokens = _tokens(body["input_ids"] if "input_ids" in body else body["text"])

        async def events() -> AsyncIterator[str]:
            output: list[int] = []
            async for ids, cached in run(tokens, max_tokens):
                output += ids
                done = len(output) == max_tokens
                yield _sse({
                    "text": bytes(output).decode(), "output_ids": list(output),
                    "meta_info": {
                        "id": "r1", "prompt_tokens": len(tokens),
                        "completion_tokens": len(output), "cached_tokens": cached,
                        "cached_tokens_details": {"device": cached, "host": 0, "storage": 0},
                        "finish_reason": {"type": "length"} if done else None,
                    },
                })
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def fake_server(state: FakeState | None = None) -> Iterator[tuple[str, FakeState]]:
    """Serve the fake app from a thread on a free loopback port; stop it on exit."""
    state = state or FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_fake_app(state), log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="fake-llm-server", daemon=True
    )
    thread.start()
    try:
        # Polled here, not with tests/waiting.py: this file also runs as a script (the
        # benchmarks' stand-in server), where the tests package is not importable.
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def main() -> None:
    """Run as a program: a stand-in for ``hicache serve`` (other flags are logged, ignored)."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, rest = parser.parse_known_args()
    print("fake server flags:", json.dumps(rest), flush=True)
    # What a CPU limit (taskset, thread variables) left this process, for the tests of --cpus.
    print(
        "fake server cpus:", json.dumps(sorted(os.sched_getaffinity(0))),
        "OMP_NUM_THREADS:", os.environ.get("OMP_NUM_THREADS"), flush=True,
    )
    sys.stdout.flush()
    uvicorn.run(
        create_fake_app(FakeState(ttft_s=0.002, itl_s=0.001)), host=args.host, port=args.port,
        log_level="warning", access_log=False, lifespan="off",
    )


if __name__ == "__main__":
    main()
