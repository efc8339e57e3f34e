"""A worker's KV events reach the index in order: live, replayed after a gap, rebuilt
after a restart, with unreadable messages skipped. Real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
import zmq.asyncio

from hicache.events.messages import encode_sequence
from hicache.router.subscriber import EventEndpoints, EventSubscriber
from tests.router_fakes import WAIT_S, DictIndex, Publisher, batch
from tests.waiting import wait_until_async

WORKER = "http://w0"


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    try:
        yield pub
    finally:
        pub.close()


async def until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    assert await wait_until_async(condition, timeout_s)


def run(publisher: Publisher, body: Callable[[EventSubscriber, DictIndex], Awaitable[None]],
        *, replay: bool = True) -> EventSubscriber:
    """``body`` with a started subscriber following ``publisher`` into a DictIndex."""
    index = DictIndex()
    endpoints = EventEndpoints(publisher.endpoint,
                               publisher.replay_endpoint if replay else None, publisher.topic)

    async def main() -> EventSubscriber:
        context = zmq.asyncio.Context()
        subscriber = EventSubscriber(WORKER, endpoints, index, context, replay_timeout_s=1.0)
        subscriber.start()
        try:
            await asyncio.to_thread(publisher.wait_subscribed)
            await body(subscriber, index)
        finally:
            await subscriber.stop()
            context.term()
        return subscriber

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_live_batches_apply_in_order(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])  # the start-up catch-up
        for h in range(1, 6):
            publisher.publish(batch(h))
        await until(lambda: sub.counts.batches == 5)
        assert index.hashes(WORKER) == [1, 2, 3, 4, 5]
        assert sub.last_sequence == 4

    sub = run(publisher, body)
    assert sub.counts.gaps == 0 and sub.counts.malformed == 0


def test_start_rebuilds_from_the_replay_buffer(publisher: Publisher) -> None:
    # Published before the router subscribed: only the replay socket still has them.
    publisher.publish(batch(10), send=False)
    publisher.publish(batch(11), send=False)

    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: sub.counts.batches == 2)
        publisher.publish(batch(12))
        await until(lambda: sub.counts.batches == 3)
        assert index.hashes(WORKER) == [10, 11, 12]
        assert index.cleared == [WORKER]  # whatever was known before is replaced

    run(publisher, body)


def test_a_gap_is_filled_from_the_replay_socket(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])
        publisher.publish(batch(1))
        publisher.publish(batch(2), send=False)  # lost on the way
        publisher.publish(batch(3), send=False)
        publisher.publish(batch(4))
        await until(lambda: sub.counts.batches == 4)
        assert index.hashes(WORKER) == [1, 2, 3, 4]
        assert publisher.replay_requests == [0, 1]
        assert sub.counts.gaps == 1

    run(publisher, body)


def test_a_gap_the_buffer_no_longer_holds_rebuilds_from_what_it_holds(
    publisher: Publisher,
) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])
        publisher.publish(batch(1))
        await until(lambda: sub.counts.batches == 1)
        publisher.publish(batch(2), send=False)
        publisher.publish(batch(3), send=False)
        publisher.forget_before(2)  # batch 2 (sequence 1) is gone from the buffer too
        publisher.publish(batch(4))
        await until(lambda: sub.last_sequence == 3)
        # Cleared and rebuilt from sequence 2 on: batch 1 might have been removed since.
        assert index.hashes(WORKER) == [3, 4]
        assert index.cleared == [WORKER, WORKER]

    run(publisher, body)


def test_a_restarted_worker_is_cleared_and_rebuilt(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])
        for h in (1, 2, 3):
            publisher.publish(batch(h))
        await until(lambda: sub.last_sequence == 2)
        publisher.restart()
        publisher.publish(batch(7), send=False)  # the new process's first batch, missed
        publisher.publish(batch(8))
        await until(lambda: index.hashes(WORKER) == [7, 8])
        assert sub.counts.restarts == 1
        assert sub.last_sequence == 1

    run(publisher, body)


def test_without_a_replay_socket_a_restart_still_clears(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        for h in (1, 2):
            publisher.publish(batch(h))
        await until(lambda: sub.last_sequence == 1)
        publisher.restart()
        publisher.publish(batch(9))
        await until(lambda: index.hashes(WORKER) == [9])

    sub = run(publisher, body, replay=False)
    assert sub.counts.replays == 0 and sub.counts.restarts == 1


def test_malformed_messages_are_counted_and_skipped(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])
        publisher.publish(batch(1))
        publisher.publish_raw(b"\x93not msgpack at all")  # sequence 1: undecodable payload
        publisher._pub.send_multipart([b"kv", b"short", b""])  # a bad sequence number
        publisher._pub.send_multipart([b"kv", encode_sequence(99)])  # two frames
        publisher.publish(batch(2))
        await until(lambda: sub.counts.batches == 2)
        assert index.hashes(WORKER) == [1, 2]
        assert sub.counts.malformed == 3
        assert sub.counts.gaps == 0  # the bad payload still took its sequence number

    run(publisher, body)


def test_other_topics_are_ignored(publisher: Publisher) -> None:
    async def body(sub: EventSubscriber, index: DictIndex) -> None:
        await until(lambda: publisher.replay_requests == [0])
        publisher._pub.send_multipart([b"other", encode_sequence(0), b"junk"])
        publisher.publish(batch(1))
        await until(lambda: sub.counts.batches == 1)
        assert sub.counts.malformed == 0

    run(publisher, body)
