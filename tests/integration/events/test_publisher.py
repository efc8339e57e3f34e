"""The ZMQ publisher over real sockets on loopback: order, sequence numbers, replay, bounds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from hicache.events.config import KVEventsConfig
from hicache.events.messages import (
    REPLAY_END_SEQUENCE,
    BlockRemoved,
    KVEventBatch,
    decode_batch,
    decode_sequence,
    encode_sequence,
)
from hicache.events.publisher import EventPublisherError, ZmqEventPublisher
from tests.waiting import wait_until

TOPIC = "kv-events"
# Waits for a batch, a replay or the publisher thread: guards against a hang, far above what
# a machine busy with other work needs.
WAIT_MS = 60_000
# Batches of about 225 kB published just before a close.
CLOSE_BATCHES = 90


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockRemoved([n], "GPU")])


def config(**overrides: object) -> KVEventsConfig:
    values: dict[str, object] = {
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC,
    }
    return KVEventsConfig(**{**values, **overrides})  # type: ignore[arg-type]


@pytest.fixture(name="context")
def context_fixture() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscriber(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher, topic: str = TOPIC
) -> zmq.Socket[bytes]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    assert publisher.endpoint is not None
    sub.connect(publisher.endpoint)
    return sub


def receive(sub: zmq.Socket[bytes]) -> tuple[int, KVEventBatch]:
    assert sub.poll(WAIT_MS), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert topic == TOPIC.encode()
    return decode_sequence(seq), decode_batch(payload)


def joined(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until the subscription has reached the PUB socket (ZMQ's slow
    joiner: earlier messages are not delivered); returns the probes' count."""
    deadline = time.monotonic() + WAIT_MS / 1000
    probes = 0
    while time.monotonic() < deadline:
        publisher.publish(batch(-1))
        probes += 1
        if sub.poll(50):
            while sub.poll(50):  # the probes still in flight
                sub.recv_multipart()
            return probes
    raise AssertionError("the subscription never reached the publisher")


def replay(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher, start: bytes
) -> list[tuple[int, bytes]]:
    """Ask for a replay from ``start`` as a DEALER; every (sequence, payload) until the end."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    assert publisher.replay_endpoint is not None
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart((b"", start))
    answers = []
    while True:
        assert dealer.poll(WAIT_MS), "the replay did not end"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        answers.append((decode_sequence(seq), payload))
        if not payload:
            dealer.close()
            return answers


@pytest.fixture(name="publisher")
def publisher_fixture() -> Iterator[ZmqEventPublisher]:
    publisher = ZmqEventPublisher(config()).start()
    yield publisher
    publisher.close()


def test_batches_arrive_in_order_with_consecutive_sequences(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
) -> None:
    sub = subscriber(context, publisher)
    probes = joined(publisher, sub)
    for n in range(20):
        publisher.publish(batch(n))
    received = [receive(sub) for _ in range(20)]
    assert [seq for seq, _ in received] == list(range(probes, probes + 20))
    assert [b.events for _, b in received] == [[BlockRemoved([n], "GPU")] for n in range(20)]
    assert publisher.num_dropped == 0


def test_other_topics_receive_nothing(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
) -> None:
    mine, other = subscriber(context, publisher), subscriber(context, publisher, "other")
    joined(publisher, mine)
    publisher.publish(batch(1))
    receive(mine)
    assert not other.poll(200)


def test_replay_resends_from_the_requested_sequence_then_ends(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
) -> None:
    for n in range(6):
        publisher.publish(batch(n))
    wait_published(publisher, 6)
    answers = replay(context, publisher, encode_sequence(3))
    assert [seq for seq, _ in answers] == [3, 4, 5, REPLAY_END_SEQUENCE]
    assert [decode_batch(p).ts for _, p in answers[:-1]] == [3.0, 4.0, 5.0]
    assert answers[-1][1] == b""
    # A start past the newest batch: only the end marker.
    assert replay(context, publisher, encode_sequence(99)) == [(REPLAY_END_SEQUENCE, b"")]


def test_a_req_client_gets_the_first_answer(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
) -> None:
    publisher.publish(batch(0))
    wait_published(publisher, 1)
    req = context.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    assert publisher.replay_endpoint is not None
    req.connect(publisher.replay_endpoint)
    req.send(encode_sequence(0))
    assert req.poll(WAIT_MS)
    seq, payload = req.recv_multipart()
    assert decode_sequence(seq) == 0 and decode_batch(payload).ts == 0.0


def test_a_malformed_replay_request_gets_just_the_end_marker(
    context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
) -> None:
    publisher.publish(batch(0))
    wait_published(publisher, 1)
    assert replay(context, publisher, b"\x01\x02") == [(REPLAY_END_SEQUENCE, b"")]


def test_the_replay_buffer_keeps_the_newest_batches(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = ZmqEventPublisher(config(buffer_steps=3)).start()
    try:
        for n in range(5):
            publisher.publish(batch(n))
        wait_published(publisher, 5)
        answers = replay(context, publisher, encode_sequence(0))
        assert [seq for seq, _ in answers] == [2, 3, 4, REPLAY_END_SEQUENCE]
    finally:
        publisher.close()


def test_a_full_queue_drops_instead_of_blocking() -> None:
    publisher = ZmqEventPublisher(config(max_queue_size=2))  # not started: nothing drains
    began = time.monotonic()
    for n in range(2 + 100):
        publisher.publish(batch(n))
    # Dropping costs microseconds; waiting even 0.1 s per dropped batch would take 10 s (and
    # a publish that blocked would never return: nothing drains).
    assert time.monotonic() - began < 10.0
    assert publisher.num_dropped == 100
    publisher.close()


def test_close_sends_what_was_queued_and_releases_the_ports() -> None:
    publisher = ZmqEventPublisher(config()).start()
    for n in range(50):
        publisher.publish(batch(n))
    publisher.close()
    # Every queued batch went out through the socket before it closed.
    assert publisher.num_published == 50
    publisher.publish(batch(99))  # after close: ignored, no error
    assert publisher.num_published == 50
    # Both addresses are free again: a new publisher binds them.
    assert publisher.endpoint is not None and publisher.replay_endpoint is not None
    again = ZmqEventPublisher(
        config(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    ).start()
    again.close()


def test_close_lets_a_subscriber_take_what_was_sent(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # A worker's last batches (a drain's EXTERNAL pages) just before it exits: nothing
    # can replay them afterwards, so close must not drop what is still on its way.
    publisher = ZmqEventPublisher(config()).start()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)  # a subscriber that takes nothing until it reads
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    assert publisher.endpoint is not None
    sub.connect(publisher.endpoint)
    probes = joined(publisher, sub)
    # About 20 MB: far more than the loopback socket buffers hold, so most of it is
    # still in the PUB socket when it closes.
    big = [BlockRemoved(list(range(1 << 40, (1 << 40) + 25_000)), "GPU")]
    for n in range(CLOSE_BATCHES):
        publisher.publish(KVEventBatch(ts=float(n), events=big))
    wait_published(publisher, probes + CLOSE_BATCHES)
    closing = threading.Thread(target=publisher.close)
    closing.start()  # it waits for the subscriber to take the rest (bounded)
    payloads = []
    try:
        # Taken as fast as they come (decoded afterwards): the close waits only so long.
        while len(payloads) < CLOSE_BATCHES and sub.poll(WAIT_MS):
            payloads.append(sub.recv_multipart()[2])
    finally:
        closing.join(WAIT_MS / 1000)
    assert [decode_batch(p).ts for p in payloads] == [float(n) for n in range(CLOSE_BATCHES)]
    assert not closing.is_alive()


def test_an_address_in_use_fails_start_with_a_clear_error(
    publisher: ZmqEventPublisher,
) -> None:
    assert publisher.endpoint is not None
    with pytest.raises(EventPublisherError, match="cannot bind the KV event sockets"):
        ZmqEventPublisher(config(endpoint=publisher.endpoint)).start()


def wait_published(publisher: ZmqEventPublisher, n: int) -> None:
    assert wait_until(lambda: publisher.num_published >= n, WAIT_MS / 1000), (
        "the publisher thread did not send")
