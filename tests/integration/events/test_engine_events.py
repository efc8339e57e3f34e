"""A scripted workload on real engines, read by a real subscriber: the exact KV event stream.

Engine 1 (L1 small, L2 on, file L3 in a tmp dir, events on) runs: a prefill
(its device->host copy held back by a gate), a second prompt sharing two pages,
an eviction of L1 to the host, a load-back, a host eviction, and /flush_cache;
engine 2, fresh, over the same L3 directory, prefetches the first prompt. After
each phase the subscriber's events must be exactly those the phase implies,
with every page hash computed here from the token ids by ``events.hashing``.
The subscriber reads a SUB socket and fills sequence gaps (a late subscription
included) from the replay socket, as a router does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.events.hashing import page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    REPLAY_END_SEQUENCE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
    decode_sequence,
    encode_sequence,
)
from tests.engine_helpers import engine_config, on_scheduler, run

PAGE = 4
TOPIC = "kv-events"
# A guard against a hang, far above what a machine busy with other work needs.
WAIT_S = 60.0
QUIET_S = 0.3
CATCH_UP_S = 0.2
# 3 whole pages and one token (always computed, never matched).
P1 = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 40]
# Shares P1's first two pages, then its own page.
P2 = [*P1[:8], 51, 52, 53, 54, 60]


class EventReader:
    """A subscriber: live batches from SUB, gaps filled from the replay socket."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], engine: Engine) -> None:
        publisher = engine.event_publisher
        assert publisher is not None and publisher.endpoint and publisher.replay_endpoint
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(publisher.endpoint)
        self.replay_socket = context.socket(zmq.DEALER)
        self.replay_socket.setsockopt(zmq.LINGER, 0)
        self.replay_socket.connect(publisher.replay_endpoint)
        self.next_sequence = 0
        self.num_replayed = 0
        self._events: list[KVEvent] = []

    def _take(self, sequence: int, payload: bytes) -> None:
        if sequence < self.next_sequence:
            return  # already had it (replayed)
        if sequence > self.next_sequence:
            self._replay(until=sequence)
        assert sequence == self.next_sequence, "the replay did not fill the gap"
        self._events.extend(decode_batch(payload).events)
        self.next_sequence += 1

    def _replay(self, until: int) -> None:
        self.replay_socket.send_multipart((b"", encode_sequence(self.next_sequence)))
        while True:
            assert self.replay_socket.poll(int(WAIT_S * 1000)), "the replay did not end"
            _, raw, payload = self.replay_socket.recv_multipart()
            sequence = decode_sequence(raw)
            if sequence == REPLAY_END_SEQUENCE:
                assert payload == b""
                return
            if self.next_sequence <= sequence < until:
                assert sequence == self.next_sequence, "replayed batches out of order"
                self._events.extend(decode_batch(payload).events)
                self.next_sequence += 1
                self.num_replayed += 1

    def _pump(self, timeout_s: float) -> bool:
        if not self.sub.poll(int(timeout_s * 1000)):
            return False
        topic, raw, payload = self.sub.recv_multipart()
        assert topic == TOPIC.encode()
        self._take(decode_sequence(raw), payload)
        return True

    def take(self, n: int) -> list[KVEvent]:
        """The next ``n`` events, then nothing more for a while.

        When SUB brings nothing for a moment, it catches up from the replay socket:
        batches published before the subscription took effect never come through
        SUB, and with no later batch there is no gap to notice them by.
        """
        deadline = time.monotonic() + WAIT_S
        while len(self._events) < n:
            assert time.monotonic() < deadline, f"expected {n} events, got {self._events}"
            if not self._pump(CATCH_UP_S):
                self._replay(until=2**62)
        quiet_until = time.monotonic() + QUIET_S
        while time.monotonic() < quiet_until:
            self._pump(0.05)
        events, self._events = self._events, []
        return events


def settle(engine: Engine) -> None:
    """Let every device->host copy and L3 put in flight finish and be acknowledged."""

    def drain() -> None:
        cache = engine.cache
        cache.poll(wait=True)
        if cache.storage is not None:
            cache.storage.controller.wait_idle(timeout=WAIT_S)
            cache.storage.poll()

    on_scheduler(engine, drain)


def stored(tokens: list[int], first_page: int, num_pages: int, medium: str) -> BlockStored:
    """The BlockStored of pages ``first_page..`` of ``tokens``, hashes computed from scratch."""
    hashes = page_hashes(tokens, PAGE)
    return BlockStored(
        block_hashes=hashes[first_page : first_page + num_pages],
        parent_block_hash=hashes[first_page - 1] if first_page else None,
        token_ids=tokens[first_page * PAGE : (first_page + num_pages) * PAGE],
        block_size=PAGE, lora_id=None, medium=medium,
    )


def removed(tokens: list[int], first_page: int, num_pages: int, medium: str) -> BlockRemoved:
    hashes = page_hashes(tokens, PAGE)
    return BlockRemoved(hashes[first_page : first_page + num_pages], medium)


class WriteGate:
    """Holds every device->host copy of an engine until opened (the copy has not landed)."""

    def __init__(self, engine: Engine) -> None:
        controller = engine.cache.controller
        assert controller is not None
        self.io = controller.io
        self.opened = threading.Event()
        self.num_waiting = 0
        real_store = self.io.store

        def gated_store(*args: Any, **kwargs: Any) -> Any:
            self.num_waiting += 1
            assert self.opened.wait(WAIT_S), "the gate was never opened"
            return real_store(*args, **kwargs)

        self.io.store = gated_store  # type: ignore[method-assign]
        copier = controller.copier  # a CPU device's writes for L3 go through it instead
        if copier is not None:
            real_copier_store = copier.store

            def gated_copier_store(*args: Any, **kwargs: Any) -> Any:
                self.num_waiting += 1
                assert self.opened.wait(WAIT_S), "the gate was never opened"
                return real_copier_store(*args, **kwargs)

            copier.store = gated_copier_store  # type: ignore[method-assign]


@pytest.fixture(name="context")
def context_fixture() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(name="engines")
def engines_fixture(tmp_path: Path) -> Iterator[Callable[[], Engine]]:
    """Engines with events on, over one file L3 directory; shut down at the end."""
    made: list[Engine] = []
    events = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    storage = {"path": str(tmp_path / "l3"), "prefetch_threshold": PAGE}

    def make() -> Engine:
        engine = build_engine(engine_config(
            "--page-size", str(PAGE), "--max-total-tokens", "256",
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps(storage),
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--kv-events-config", json.dumps(events),
        ))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def test_a_scripted_workload_publishes_exactly_its_tier_transitions(
    context: zmq.Context[zmq.Socket[bytes]], engines: Callable[[], Engine],
    request: pytest.FixtureRequest,
) -> None:
    engine = engines()
    reader = EventReader(context, engine)
    cache = engine.cache

    # 1. Fresh prefill: store(GPU) at once; store(CPU_PINNED) only once the copy has
    # landed, however many steps that takes; then the L3 put: store(EXTERNAL).
    gate = WriteGate(engine)
    request.addfinalizer(gate.opened.set)  # before the engines shut down, if this fails
    run(engine, P1, max_new_tokens=1)
    assert reader.take(1) == [stored(P1, 0, 3, MEDIUM_GPU)]  # and nothing for QUIET_S
    assert gate.num_waiting == 1, "the copy was issued and is held"
    gate.opened.set()
    settle(engine)
    assert reader.take(2) == [stored(P1, 0, 3, MEDIUM_CPU), stored(P1, 0, 3, MEDIUM_EXTERNAL)]

    # 2. A prompt sharing two pages: only its own page is new, chained from page 1.
    run(engine, P2, max_new_tokens=1)
    settle(engine)
    assert reader.take(3) == [
        stored(P2, 2, 1, MEDIUM_GPU), stored(P2, 2, 1, MEDIUM_CPU),
        stored(P2, 2, 1, MEDIUM_EXTERNAL),
    ]

    # 3. L1 evicted to the host, least recently used leaf first (P1's own page, then
    # P2's, then the shared two pages once no device child hangs from them).
    assert engine.evict_device_cache() == 4
    assert reader.take(3) == [
        removed(P1, 2, 1, MEDIUM_GPU), removed(P2, 2, 1, MEDIUM_GPU),
        removed(P1, 0, 2, MEDIUM_GPU),
    ]

    # 4. Load-back of P1's pages from the host, node by node.
    hit = run(engine, P1, max_new_tokens=1).last.cached_tokens
    assert (hit.device, hit.host) == (0, 12)
    settle(engine)
    assert reader.take(2) == [stored(P1, 0, 2, MEDIUM_GPU), stored(P1, 2, 1, MEDIUM_GPU)]

    # 5. Host eviction: P2's page is in L2 only, so it leaves this worker altogether.
    def evict_one_host_page() -> None:
        assert cache.host_pool is not None
        allocator = cache.host_pool.allocator
        allocator.free(cache.alloc_host(allocator.num_free_pages + 1))

    on_scheduler(engine, evict_one_host_page)
    assert reader.take(1) == [removed(P2, 2, 1, MEDIUM_CPU)]

    # 6. /flush_cache.
    assert engine.flush_cache()
    assert reader.take(1) == [AllBlocksCleared()]
    assert reader.next_sequence == engine.event_publisher.num_published  # type: ignore[union-attr]
    engine.shutdown()

    # 7. A fresh engine over the same L3: P1's pages come from L3 into the host
    # (store CPU_PINNED, and EXTERNAL: this worker found them there), then load back.
    fresh = engines()
    reader = EventReader(context, fresh)
    hit = run(fresh, P1, max_new_tokens=1).last.cached_tokens
    assert hit.storage == 12
    settle(fresh)
    assert reader.take(3) == [
        stored(P1, 0, 3, MEDIUM_CPU), stored(P1, 0, 3, MEDIUM_EXTERNAL),
        stored(P1, 0, 3, MEDIUM_GPU),
    ]
