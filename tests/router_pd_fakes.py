"""Fake prefill and decode instances (real FastAPI apps on loopback) for the PD router.

They keep the engine side's contract: a request without the three bootstrap
fields is a 400; the prefill instance answers with one token (its status is all
the router reads); the decode instance waits until the prefill instance has
"sent" the room's KV (a shared :class:`Rooms` board stands for the transfer)
and then answers, streaming or whole. Each can be told to fail, and records the
requests it got and those whose client (the router) went away.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response, StreamingResponse

from hicache.events.hashing import page_hashes
from tests.router_fakes import Publisher, batch
from tests.server_fixtures import serve_app_in_thread

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
DECODE_CHUNKS = [b'data: {"text":"x"}\n\n', b'data: {"text":"xy"}\n\n',
                 b'data: {"text":"xy\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]


class Rooms:
    """Rooms whose KV the prefill side has sent: what the decode side waits for."""

    def __init__(self) -> None:
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def mark(self, room: int) -> None:
        with self._lock:
            self._done.add(room)

    def has(self, room: int) -> bool:
        with self._lock:
            return room in self._done


@dataclass
class FakeInstance:
    mode: str  # "prefill" or "decode"
    rooms: Rooms
    page_size: int = 4
    model: str = "tiny-model"
    delay_s: float = 0.0  # prefill: before answering; decode: between streamed chunks
    fail_status: int | None = None  # answer every request with this error status
    report_mode: bool = True  # /get_server_info says disaggregation_mode
    kv_wait_s: float = 5.0  # decode: how long it waits for the room's KV
    healthy: bool = True
    # The drain contract: /health 503 {"status": "draining"}, new requests a 503 saying
    # so with Retry-After: 0.
    draining: bool = False
    health_delay_s: float = 0.0  # before /health answers (a busy instance's slow probe)
    health_checks: int = 0  # /health requests that came in
    # Prefill: publishes its prompts' pages here once computed (as a worker's KV events).
    publisher: Publisher | None = None
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    flushed: int = 0
    aborts: list[dict[str, Any]] = field(default_factory=list)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"page_size": self.page_size, "served_model_name": self.model,
                                "model_path": f"/models/{self.model}", "tokenizer_path": None}
        if self.report_mode:
            info.update(disaggregation_mode=self.mode, disaggregation_bootstrap_port=8998)
        if self.publisher is not None:
            info.update(kv_events_endpoint=self.publisher.endpoint,
                        kv_events_replay_endpoint=self.publisher.replay_endpoint,
                        kv_events_topic=self.publisher.topic)
        return info


def fake_instance_app(instance: FakeInstance) -> FastAPI:
    app = FastAPI()

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return instance.info()

    @app.get("/health")
    async def health() -> Response:
        instance.health_checks += 1
        await asyncio.sleep(instance.health_delay_s)  # a slow health check, on purpose
        if instance.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({}, status_code=200 if instance.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": instance.model, "mode": instance.mode}]}

    @app.post("/flush_cache")
    async def flush() -> dict[str, Any]:
        instance.flushed += 1
        return {"flushed": True}

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        instance.aborts.append(await request.json())
        return Response(status_code=200)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"text": bytes(body["tokens"]).decode(), "mode": instance.mode}

    async def answer(request: Request) -> Response:
        body = await request.json()
        instance.requests.append((request.url.path, body))
        missing = [name for name in BOOTSTRAP_FIELDS if name not in body]
        if missing:
            return JSONResponse({"error": {"message": f"{instance.mode} instance: missing "
                                           f"{', '.join(missing)}"}}, status_code=400)
        if instance.draining:
            return JSONResponse({"error": {"message": f"{instance.mode} instance is draining: "
                                           "retry on another one"}}, status_code=503,
                                headers={"Retry-After": "0"})
        if instance.fail_status is not None:
            return JSONResponse({"error": {"message": f"{instance.mode} failed on purpose"}},
                                status_code=instance.fail_status)
        tag = str(body.get("tag", ""))
        room = int(body["bootstrap_room"])
        loop = asyncio.get_running_loop()
        if instance.mode == "prefill":
            deadline = loop.time() + instance.delay_s
            if not await _until(request, lambda: loop.time() >= deadline):
                instance.cancelled.append(tag)
                return Response(status_code=499)
            instance.rooms.mark(room)
            ids = body.get("input_ids")
            if instance.publisher is not None and isinstance(ids, list):
                pages = page_hashes(ids, instance.page_size)
                if pages:
                    instance.publisher.publish(batch(*pages))
            return JSONResponse({"text": "x", "meta_info": {"completion_tokens": 1}})
        # As a decode instance: the request waits until its KV landed, else fails.
        deadline = loop.time() + instance.kv_wait_s
        if not await _until(request, lambda: instance.rooms.has(room)
                            or loop.time() >= deadline):
            instance.cancelled.append(tag)
            return Response(status_code=499)
        if not instance.rooms.has(room):
            return JSONResponse({"error": {"message": f"room {room}: the KV never came"}},
                                status_code=500)
        if not body.get("stream"):
            return JSONResponse({"text": "xy", "echo": body})

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for chunk in DECODE_CHUNKS:
                    yield chunk
                    await asyncio.sleep(instance.delay_s)  # a slow stream, on purpose
            except (asyncio.CancelledError, GeneratorExit):
                instance.cancelled.append(tag)
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        app.add_api_route(path, answer, methods=["POST"])
    return app


async def _until(request: Request, condition: Callable[[], bool]) -> bool:
    """Poll ``condition``; False as soon as the request's client went away (as an engine
    aborts a request whose connection closed)."""
    while not condition():
        if await request.is_disconnected():
            return False
        # The stand-in instance's own wait (for the KV, as a decode instance waits), not
        # a test waiting: it has no deadline of its own and watches its client.
        await asyncio.sleep(0.01)
    return True


@contextmanager
def fake_instances(*instances: FakeInstance) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_app_in_thread(fake_instance_app(i)))
               for i in instances]
