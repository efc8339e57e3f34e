"""One worker's KV events into the index, in order, with gaps filled from its replay socket.

A worker publishes on a ZMQ PUB socket multipart messages ``(topic, 8-byte
big-endian sequence, msgpack KVEventBatch)`` and answers replay requests on a
ROUTER socket, as SGLang and vLLM do: a DEALER sends ``[b"", start_sequence]``
and gets ``[b"", sequence, payload]`` for every buffered batch from there on
(some publishers put the topic before the sequence), then ``sequence == -1``
with an empty payload.

The subscriber keeps the index equal to what the worker announced:

- at start, the index's entries for the worker are cleared and rebuilt from the
  whole replay buffer (sequence 0 on), so a worker that was serving before the
  router came (or came back) is known at once;
- a sequence jump (lost messages, a slow subscription) asks the replay socket
  for the missing batches; when the buffer no longer holds them, the worker's
  entries are cleared and rebuilt from what it still holds;
- a sequence going back means the worker restarted (its new publisher counts
  from 0): cleared and rebuilt the same way;
- a payload that does not decode is counted, logged and skipped.

Live messages the replay already delivered (they wait in the SUB queue while
the replay runs) are recognised by their sequence *and* bytes, so they are not
mistaken for a restart, whose batches carry new timestamps.

Everything runs on the router's event loop (zmq.asyncio), so index updates never
race the policies reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from hicache.events.messages import (
    REPLAY_END_SEQUENCE,
    decode_batch,
    decode_sequence,
    encode_sequence,
)
from hicache.router.types import TierIndex

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0  # longest wait for each message of a replay answer


@dataclass(frozen=True)
class EventEndpoints:
    """Where a worker publishes (SGLang's --kv-events-config, as the router can reach it)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class SubscriberCounts:
    """Plain numbers the metrics read at scrape time."""

    batches: int = 0  # applied to the index, live or replayed
    gaps: int = 0  # sequence jumps seen
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that got no complete answer in time
    restarts: int = 0  # sequence went back: the worker's publisher started over
    malformed: int = 0  # messages or payloads that could not be read
    last_sequence: int | None = None


class EventSubscriber:
    """Feeds ``index`` from one worker's events; ``start`` and ``stop`` own its task."""

    def __init__(
        self, worker: str, endpoints: EventEndpoints, index: TierIndex,
        context: zmq.asyncio.Context, *, counts: SubscriberCounts | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.worker = worker
        self.endpoints = endpoints
        self.counts = counts if counts is not None else SubscriberCounts()
        self._index = index
        self._context = context
        self._replay_timeout_s = replay_timeout_s
        self._task: asyncio.Task[None] | None = None
        # Batches the last replay delivered, by sequence: their live copies are duplicates.
        self._replayed: dict[int, bytes] = {}

    @property
    def last_sequence(self) -> int | None:
        return self.counts.last_sequence

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kv-events {self.worker}"
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
        try:
            sub.connect(self.endpoints.endpoint)
            logger.info("%s: subscribed to KV events at %s (topic %r)", self.worker,
                        self.endpoints.endpoint, self.endpoints.topic)
            await self._catch_up(0, rebuild=True)
            while True:
                frames = await sub.recv_multipart()
                await self._on_live(frames)
        except zmq.ZMQError as error:
            # A bad endpoint string, or the context closed under us: nothing to retry.
            logger.error("%s: KV event subscription stopped: %s", self.worker, error)
        finally:
            sub.close(linger=0)

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(f"a message of {len(frames)} frames (expected topic, sequence, "
                            "payload)")
            return
        _, raw_sequence, payload = frames
        try:
            sequence = decode_sequence(raw_sequence)
        except ValueError as error:
            self._malformed(str(error))
            return
        last = self.counts.last_sequence
        if last is not None and sequence <= last:
            if self._replayed.get(sequence) == payload:
                return  # the replay delivered it already
            self.counts.restarts += 1
            logger.warning("%s: KV event sequence went back from %d to %d: the worker "
                           "restarted; rebuilding its index", self.worker, last, sequence)
            await self._catch_up(0, rebuild=True)
        elif last is not None and sequence > last + 1:
            self.counts.gaps += 1
            logger.warning("%s: KV events %d..%d missed; asking the replay socket",
                           self.worker, last + 1, sequence - 1)
            await self._catch_up(last + 1, rebuild=False)
        last = self.counts.last_sequence
        if last is None or sequence > last:
            self._replayed.clear()  # live messages are in order: no duplicate comes after this
            self._apply(sequence, payload)

    async def _catch_up(self, start: int, *, rebuild: bool) -> None:
        """Apply the batches from ``start`` on that the replay socket holds. With
        ``rebuild``, or when the buffer starts past ``start`` (the missing batches
        are gone), the worker's entries are cleared first and rebuilt from it."""
        replayed = await self._fetch_replay(start)
        if replayed is None:
            if rebuild:
                # No history to be had: forget what may be stale, go on from live events.
                self._index.clear_worker(self.worker)
                self.counts.last_sequence = None
            return
        covered = bool(replayed) and replayed[0][0] <= start
        if rebuild or not covered:
            if not rebuild:
                logger.warning("%s: the replay buffer no longer holds batch %d: rebuilding "
                               "the worker's index from what it holds", self.worker, start)
            self._index.clear_worker(self.worker)
            self.counts.last_sequence = None
        self._replayed = dict(replayed)
        for sequence, payload in replayed:
            last = self.counts.last_sequence
            if last is None or sequence > last:
                self._apply(sequence, payload)

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay socket's batches from ``start`` on, in order; None without a replay
        endpoint or when the answer does not come whole in time."""
        if self.endpoints.replay_endpoint is None:
            return None
        self.counts.replays += 1
        # A fresh socket per replay: a late answer to an abandoned one cannot mix in.
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.endpoints.replay_endpoint)
            await dealer.send_multipart([b"", encode_sequence(start)])
            while True:
                if not await dealer.poll(int(self._replay_timeout_s * 1000)):
                    self.counts.replay_failures += 1
                    logger.warning("%s: no complete replay answer from %s within %.1f s",
                                   self.worker, self.endpoints.replay_endpoint,
                                   self._replay_timeout_s)
                    return None
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    frames = frames[1:]  # [topic, sequence, payload]
                if len(frames) != 2:
                    self._malformed(f"a replay message of {len(frames)} frames")
                    continue
                try:
                    sequence = decode_sequence(frames[0])
                except ValueError as error:
                    self._malformed(f"replay: {error}")
                    continue
                if sequence == REPLAY_END_SEQUENCE:
                    return sorted(batches)
                batches.append((sequence, frames[1]))
        except zmq.ZMQError as error:
            self.counts.replay_failures += 1
            logger.warning("%s: replay from %s failed: %s", self.worker,
                           self.endpoints.replay_endpoint, error)
            return None
        finally:
            dealer.close(linger=0)

    def _apply(self, sequence: int, payload: bytes) -> None:
        self.counts.last_sequence = sequence  # a bad batch is skipped, not asked for again
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as error:
            self._malformed(f"batch {sequence}: {error}")
            return
        try:
            self._index.apply(self.worker, batch)
        except (ValueError, KeyError, TypeError) as error:
            # Decodable but not something the index can take (an unknown medium ...).
            self._malformed(f"batch {sequence} refused by the index: {error}")
            return
        self.counts.batches += 1

    def _malformed(self, what: str) -> None:
        self.counts.malformed += 1
        logger.warning("%s: skipped a malformed KV event message: %s (%d so far)",
                       self.worker, what, self.counts.malformed)
