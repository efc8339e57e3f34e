"""The ZMQ event publisher: one thread owns the sockets, the scheduler only enqueues.

Wire protocol (SGLang's and vLLM's, so their routers and subscribers read us):

- PUB socket bound to ``endpoint``: each batch is one multipart message
  ``[topic, sequence (8 bytes, big-endian, signed), msgpack KVEventBatch]``.
  Sequence numbers start at 0 and grow by one per batch, so a subscriber that
  sees a gap knows it missed batches (ZMQ drops for slow subscribers past ``hwm``).
- ROUTER socket bound to ``replay_endpoint`` (optional): a request whose last
  frame is an 8-byte start sequence is answered with every buffered batch from
  that sequence on, each ``[identity, b"", sequence, payload]``, then
  ``[identity, b"", sequence -1, b""]``. A DEALER client sends ``[b"", start]``
  and reads ``[b"", sequence, payload]`` frames until the empty payload; a REQ
  client (vLLM's example) gets the first answer only, REQ being one reply per request.
  The buffer keeps the newest ``buffer_steps`` batches.

Why a thread: ``publish`` is called on the scheduler thread, which must never
block or do I/O. It puts the batch on a bounded queue (dropping and counting
when full, which means the publisher thread is starved, not that a subscriber
is slow); the thread encodes, numbers, sends, buffers and answers replays.
ZMQ sockets are not thread-safe, so the thread creates, uses and closes both.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Final, Protocol

import zmq

from hicache.events.config import KVEventsConfig
from hicache.events.messages import (
    REPLAY_END_SEQUENCE,
    SEQUENCE_BYTES,
    KVEventBatch,
    encode_batch,
    encode_sequence,
)

logger = logging.getLogger(__name__)

_STOP: Final = object()
# How long the thread waits for a batch before looking at the replay socket again.
_IDLE_POLL_S: Final = 0.05
_START_TIMEOUT_S: Final = 10.0
_JOIN_TIMEOUT_S: Final = 10.0
# How long a closing publisher still lets subscribers take what was sent: the last batches
# of a worker that exits (a drain's EXTERNAL pages) reach no one otherwise, as there is no
# process left to replay them. Bounded: a stuck subscriber does not hold the exit.
CLOSE_LINGER_S: Final = 2.0


class EventPublisherError(OSError):
    """The publisher could not start (an endpoint that cannot be bound)."""


class EventPublisher(Protocol):
    """Where the cache's event batches go (one per scheduler step that has events)."""

    def publish(self, batch: KVEventBatch) -> None:
        """Hand over a batch; never blocks."""

    def close(self) -> None:
        """Send what was handed over, then release everything."""


class ZmqEventPublisher:
    """See the module docstring. ``start`` binds (or raises); ``close`` drains and joins."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | object] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._closed = False
        # Read by other threads for reporting; written only by the publisher thread.
        self.endpoint: str | None = None  # as bound (a wildcard port resolved)
        self.replay_endpoint: str | None = None
        self.num_published = 0
        self.num_replay_requests = 0
        # Written only by the scheduler thread.
        self.num_dropped = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> ZmqEventPublisher:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run, name="hicache-kv-events", daemon=True
        )
        self._thread.start()
        if not self._started.wait(_START_TIMEOUT_S):
            raise EventPublisherError("the KV event publisher did not start in time")
        if self._start_error is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
            self._thread = None
            self._context.term()
            raise EventPublisherError(
                f"cannot bind the KV event sockets ({self.config.endpoint}, replay "
                f"{self.config.replay_endpoint}): {self._start_error}; pick free addresses "
                "in --kv-events-config"
            ) from self._start_error
        logger.info(
            "KV events: publishing on %s (topic %r), replay on %s",
            self.endpoint, self.config.topic, self.replay_endpoint or "off",
        )
        return self

    def close(self) -> None:
        """Publish what is queued, close both sockets and join the thread. What was sent
        still goes out to the subscribers for up to ``CLOSE_LINGER_S``, then is dropped."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            try:  # the thread is draining the queue: room comes unless it died
                self._queue.put(_STOP, timeout=_JOIN_TIMEOUT_S)
            except queue.Full:
                logger.warning("the KV event publisher thread is not draining its queue")
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the KV event publisher thread did not stop in time")
            self._thread = None
        self._context.term()

    # --------------------------------------------------------- the scheduler's side
    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events: %d batches dropped, the publisher thread is not keeping up "
                    "(max_queue_size %d): routers will see a sequence gap",
                    self.num_dropped, self.config.max_queue_size,
                )

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            pub = self._context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            replay: zmq.Socket[bytes] | None = None
            try:
                pub.bind(self.config.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                if self.config.replay_endpoint is not None:
                    replay = self._context.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(self.config.replay_endpoint)
                    self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as error:
                pub.close()
                if replay is not None:
                    replay.close()
                self._start_error = error
                return
        finally:
            self._started.set()
        try:
            self._serve(pub, replay)
            # Closing: what the subscribers have not taken yet still goes out (a socket
            # closed with linger 0 drops it). Only the PUB socket: a replay is not awaited.
            pub.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))
        except Exception:  # a bug here must not pass silently: routers would go stale
            logger.exception("the KV event publisher thread failed; no more events")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        sequence = 0
        while True:
            if replay is not None and replay.poll(0):
                self._answer_replay(replay, buffer)
            try:
                item = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            assert isinstance(item, KVEventBatch)
            payload = encode_batch(item)
            pub.send_multipart((self._topic, encode_sequence(sequence), payload))
            buffer.append((sequence, payload))
            sequence += 1
            self.num_published = sequence

    def _answer_replay(
        self, replay: zmq.Socket[bytes], buffer: deque[tuple[int, bytes]]
    ) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            self.num_replay_requests += 1
            identity, start_frame = frames[0], frames[-1]
            if len(frames) < 2 or len(start_frame) != SEQUENCE_BYTES:
                # Answer anyway (just the end marker) so the client does not wait forever.
                logger.warning(
                    "KV events: a replay request without an %d-byte start sequence "
                    "(%d frames): answered with nothing", SEQUENCE_BYTES, len(frames),
                )
            else:
                start = int.from_bytes(start_frame, "big", signed=True)
                for seq, payload in buffer:
                    if seq >= start:
                        replay.send_multipart((identity, b"", encode_sequence(seq), payload))
            replay.send_multipart((identity, b"", encode_sequence(REPLAY_END_SEQUENCE), b""))


