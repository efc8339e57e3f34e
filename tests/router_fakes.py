"""Stand-ins for the router's tests: a dict index, two tiny policies, a KV event publisher
(real ZMQ sockets on loopback) and a fake worker (a real FastAPI app) that publishes.

The publisher speaks the workers' wire format: XPUB (a PUB that also tells when a
subscriber joined, so tests need not sleep) sending ``(topic, sequence, payload)``,
and a ROUTER replay socket answering ``[b"", start]`` with every buffered batch
from there, then ``-1`` and an empty payload.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response, StreamingResponse

from hicache.events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    encode_sequence,
)
from hicache.router.types import RouteDecision, RouteRequest, TierOverlap
from tests.server_fixtures import serve_app_in_thread

# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0


class DictIndex:
    """A TierIndex over dicts: worker -> medium -> hashes; keeps every batch applied."""

    def __init__(self) -> None:
        self.pages: dict[str, dict[str, set[int]]] = {}
        self.applied: dict[str, list[KVEventBatch]] = {}
        self.cleared: list[str] = []
        self.removed: list[str] = []

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        self.applied.setdefault(worker, []).append(batch)
        tiers = self.pages.setdefault(worker, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                tiers.setdefault(event.medium or "GPU", set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                tiers.setdefault(event.medium or "GPU", set()).difference_update(
                    event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                tiers.clear()

    def clear_worker(self, worker: str) -> None:
        self.cleared.append(worker)
        self.pages.pop(worker, None)
        self.applied.pop(worker, None)

    def remove_worker(self, worker: str) -> None:
        self.removed.append(worker)
        self.pages.pop(worker, None)
        self.applied.pop(worker, None)

    def overlaps(self, page_hashes: Sequence[int], workers: Sequence[str],
                 ) -> dict[str, TierOverlap]:
        out = {}
        for worker in workers:
            gpu = self.pages.get(worker, {}).get("GPU", set())
            count = sum(1 for _ in itertools.takewhile(gpu.__contains__, page_hashes))
            out[worker] = TierOverlap(gpu=count, host=count, external=count)
        return out

    def num_pages(self) -> int:
        return sum(len(s) for tiers in self.pages.values() for s in tiers.values())

    def hashes(self, worker: str) -> list[int]:
        """Every page hash the worker's applied batches stored, in order."""
        return [h for b in self.applied.get(worker, []) for e in b.events
                if isinstance(e, BlockStored) for h in e.block_hashes]


class FirstPolicy:
    """The first candidate; records what it was asked."""

    name = "first"

    def __init__(self, index: DictIndex | None = None) -> None:
        self.index = index
        self.requests: list[RouteRequest] = []

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        self.requests.append(request)
        urls = [w.url for w in request.workers]
        overlaps = self.index.overlaps(request.page_hashes, urls) if self.index else {}
        return RouteDecision(worker=urls[0], policy=self.name, overlaps=overlaps,
                             shared_hits=len(request.page_hashes), shared_beyond=1)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        worker = request.workers[self._next % len(request.workers)].url
        self._next += 1
        return RouteDecision(worker=worker, policy=self.name)


def batch(*hashes: int, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[
        BlockStored(list(hashes), None, list(range(len(hashes))), 1, None, medium)])


class Publisher:
    """A worker's KV event sockets on free loopback ports."""

    def __init__(self, topic: str = "kv") -> None:
        self.topic = topic
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.next_sequence = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_s: float = WAIT_S) -> None:
        """Until a subscriber's subscription reached this socket."""
        deadline = time.monotonic() + timeout_s
        while True:  # skipping unsubscriptions (a subscriber that went away)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._pub.poll(left_ms):
                raise TimeoutError("no subscriber joined")
            if self._pub.recv()[:1] == b"\x01":
                return

    def publish(self, event_batch: KVEventBatch, *, send: bool = True) -> int:
        """Buffer the batch under the next sequence; ``send=False``: lost on the way."""
        return self.publish_raw(encode_batch(event_batch), send=send)

    def publish_raw(self, payload: bytes, *, send: bool = True) -> int:
        with self._lock:
            sequence = self.next_sequence
            self.next_sequence += 1
            self.buffer.append((sequence, payload))
        if send:
            self._pub.send_multipart([self.topic.encode(), encode_sequence(sequence), payload])
        return sequence

    def restart(self) -> None:
        """As a restarted worker's new publisher: counting from 0, an empty buffer."""
        with self._lock:
            self.next_sequence = 0
            self.buffer.clear()

    def forget_before(self, sequence: int) -> None:
        """The replay buffer overflowed: batches before ``sequence`` are gone."""
        with self._lock:
            self.buffer = [(s, p) for s, p in self.buffer if s >= sequence]

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._replay.poll(50):
                continue
            client, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            self.replay_requests.append(first)
            with self._lock:
                held = [(s, p) for s, p in self.buffer if s >= first]
            for sequence, payload in held:
                self._replay.send_multipart([client, b"", encode_sequence(sequence), payload])
            self._replay.send_multipart([client, b"", encode_sequence(-1), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        self._replay.close(0)
        self._context.term()


@dataclass
class FakeWorker:
    """What a fake worker saw: each request's path and body, and those whose client left."""

    page_size: int = 4
    model: str = "tiny-model"
    publisher: Publisher | None = None
    healthy: bool = True
    stream_delay_s: float = 0.0  # between streamed chunks
    answer_delay_s: float = 0.0  # before a non-streamed answer
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # each request's, in order
    cancelled: list[str] = field(default_factory=list)
    flushed: int = 0
    aborts: list[dict[str, Any]] = field(default_factory=list)
    extra_info: dict[str, Any] = field(default_factory=dict)  # more /get_server_info fields
    # POST /hicache/hints: each item answered with this outcome (tokens: its ids), or the
    # whole call refused with hint_status when that is not 200.
    hint_outcome: str = "accepted"
    hint_status: int = 200
    metrics_text: str | None = None  # GET /metrics's answer; None: a 404

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"page_size": self.page_size, "served_model_name": self.model,
                                "model_path": f"/models/{self.model}", "tokenizer_path": None,
                                **self.extra_info}
        if self.publisher is not None:
            info.update(kv_events_endpoint=self.publisher.endpoint,
                        kv_events_replay_endpoint=self.publisher.replay_endpoint,
                        kv_events_topic=self.publisher.topic)
        return info


STREAM_CHUNKS = [b'data: {"text":"a"}\n\n', b'data: {"text":"ab"}\n\n', b': keep-alive\n\n',
                 b'data: {"text":"abc","x":"\xc3\xa9"}\n\n', b"data: [DONE]\n\n"]


def fake_worker_app(worker: FakeWorker) -> FastAPI:
    app = FastAPI()

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return worker.info()

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"ok": worker.healthy}, status_code=200 if worker.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if worker.metrics_text is None:
            return Response(status_code=404)
        return Response(worker.metrics_text, media_type="text/plain")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": worker.model}]}

    @app.post("/flush_cache")
    async def flush() -> dict[str, Any]:
        worker.flushed += 1
        return {"flushed": True}

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        worker.aborts.append(await request.json())
        return Response(status_code=200)

    @app.post("/hicache/hints")
    async def hints(request: Request) -> Response:
        body = await request.json()
        worker.requests.append((request.url.path, body))
        worker.headers.append(dict(request.headers))
        if worker.hint_status != 200:
            return JSONResponse({"error": {"message": "the worker is draining"}},
                                status_code=worker.hint_status)
        return JSONResponse({"results": [
            {"index": i, "kind": item["kind"], "outcome": worker.hint_outcome,
             "tokens": len(item["input_ids"]), "clipped_tokens": 0, "reason": ""}
            for i, item in enumerate(body["hints"])
        ]})

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        worker.requests.append((request.url.path, body))
        ids = list(str(body["prompt"]).encode())
        return {"tokens": ids, "count": len(ids), "max_model_len": 64}

    async def answer(request: Request) -> Response:
        body = await request.json()
        worker.requests.append((request.url.path, body))
        worker.headers.append(dict(request.headers))
        tag = str(body.get("tag", ""))
        if not body.get("stream"):
            # As a worker does: the request is dropped when its client is gone.
            deadline = time.monotonic() + worker.answer_delay_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    worker.cancelled.append(tag)
                    return Response(status_code=499)
                await asyncio.sleep(0.02)  # a slow worker on purpose, watching its client
            return JSONResponse({"path": request.url.path, "echo": body})

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for chunk in STREAM_CHUNKS:
                    yield chunk
                    await asyncio.sleep(worker.stream_delay_s)  # a slow stream, on purpose
            except (asyncio.CancelledError, GeneratorExit):
                worker.cancelled.append(tag)
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")

    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        app.add_api_route(path, answer, methods=["POST"])
    return app


@contextmanager
def fake_workers(*workers: FakeWorker) -> Iterator[list[str]]:
    """Each fake worker served on its own loopback port; yields their urls."""
    with ExitStack() as stack:
        yield [stack.enter_context(serve_app_in_thread(fake_worker_app(w))) for w in workers]


@contextmanager
def dropping_server() -> Iterator[str]:
    """A loopback server that reads each request and closes the connection without a byte
    of answer (a worker dying as it takes a request); yields its url."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    stop = threading.Event()
    hits: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                with suppress(OSError):
                    conn.recv(65536)
                hits.append(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
