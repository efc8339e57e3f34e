"""The disaggregation transfer layer alone: plans, rooms, and KV moved between two
processes' device pools by the Mooncake TransferEngine (loopback, TCP), bit for bit."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hicache.disaggregation.bootstrap_server import BootstrapServer
from hicache.disaggregation.kv_receiver import UNREACHABLE_GRACE_S, KVReceiver, ReceiveJob
from hicache.disaggregation.kv_sender import KVSender, SendJob
from hicache.disaggregation.pool_descriptor import (
    IncompatiblePoolError,
    PoolDescriptor,
    transfer_plan,
)
from hicache.disaggregation.rooms import Registration, RoomState, RoomTable
from hicache.disaggregation.transfer_engine import KVTransferEngine
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.net import free_port
from tests.decode_peer import GEOMETRY, decode_peer_main, make_pool
from tests.dev_dependency import require_dev_dependency
from tests.waiting import wait_until

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

# Waits for an outcome (a peer process spawned and importing torch included): guards
# against a hang, far above what a machine busy with other work needs.
WAIT_S = 90.0
# What a job waits for before it gives up by itself, where a test ends it otherwise: far
# past AT_ONCE_S, so that a loaded machine stays far under the bound and a job left to
# its timeout is far over it.
LONG_TIMEOUT_S = 600.0
AT_ONCE_S = 30.0


def test_plan_merges_runs_and_addresses_every_layer_and_kv() -> None:
    pool = make_pool()
    desc = PoolDescriptor.of(pool)
    plan = transfer_plan(desc, np.array([3, 4, 5, 9]), desc, np.array([10, 11, 12, 13]))
    # Two runs ([3..5] -> [10..12], [9] -> [13]) for each of 3 layers x K, V.
    assert len(plan.sources) == 2 * 3 * 2
    assert plan.num_bytes == 4 * pool.page_bytes
    # Every chunk addresses exactly the rows the canonical view says.
    element = pool.geometry.element_bytes
    base = pool.flat.data_ptr()
    for layer in range(3):
        for kv in (0, 1):
            row = pool.pages[3, layer, kv]  # [page_size, row]
            assert row.data_ptr() - base in {s - base for s in plan.sources}
    assert all(length % element == 0 for length in plan.lengths)


def test_plan_of_an_mla_pool_copies_its_one_latent_plane() -> None:
    mla = DevicePool(KVGeometry.mla(num_layers=2, latent_dim=24, dtype=GEOMETRY.dtype), 8, 4)
    mla.flat.copy_(torch.randn(mla.flat.numel()).to(mla.flat.dtype))
    other = DevicePool(mla.geometry, 8, 4)
    plan = transfer_plan(PoolDescriptor.of(mla), np.array([1, 6]),
                         PoolDescriptor.of(other), np.array([3, 4]))
    assert len(plan.sources) == 2 * 2 * 1 and plan.num_bytes == 2 * mla.page_bytes
    # Applied here with memmove, the plan puts exactly those pages there.
    for src, dst, length in zip(plan.sources, plan.destinations, plan.lengths, strict=True):
        ctypes.memmove(dst, src, length)
    assert torch.equal(other.pages[torch.tensor([3, 4])], mla.pages[torch.tensor([1, 6])])
    assert not other.pages[torch.tensor([0, 1, 2, 5, 6, 7])].any()


def test_plan_refuses_a_foreign_pool() -> None:
    other = DevicePool(KVGeometry(3, 2, 16, GEOMETRY.dtype), 8, 4)
    with pytest.raises(IncompatiblePoolError, match="KV pools differ"):
        transfer_plan(PoolDescriptor.of(make_pool()), np.array([0]),
                      PoolDescriptor.of(other), np.array([0]))


def test_room_waits_for_registration_and_times_out() -> None:
    rooms = RoomTable(stale_after_s=60)
    outcome = rooms.wait_registration(1, time.monotonic() + 0.05)
    assert not isinstance(outcome, Registration) and outcome.state is RoomState.FAILED
    assert rooms.status(1, 0).state is RoomState.FAILED
    assert len(rooms) == 0  # read in its final state: forgotten


def test_a_room_being_sent_is_not_cancelled_under_the_sender() -> None:
    rooms = RoomTable(stale_after_s=60)
    registration = Registration("s", PoolDescriptor.of(make_pool()), np.array([0]))
    rooms.register(7, registration)
    assert rooms.wait_registration(7, time.monotonic() + 1) == registration
    assert rooms.cancel(7, "gave up") is RoomState.SENDING
    assert rooms.status(7, 0).state is RoomState.SENDING  # still written to
    rooms.finish(7, 42, None)
    status = rooms.status(7, 0)
    assert (status.state, status.first_token) == (RoomState.DONE, 42)


# What a prefill instance sends with a first token when logprobs were asked for.
LOGPROBS = {"input": [[3, None, [], []], [8, -1.25, [[8, -1.25], [2, -2.5]], [-7.0]]],
            "first": [1234, -0.5, [[1234, -0.5], [9, -3.0]], [-6.5]]}


@pytest.fixture(name="prefill")
def prefill_fixture() -> Iterator[dict[str, Any]]:
    """A prefill side in this process: a pool of random KV, its engine, rooms, server, sender."""
    pool = make_pool()
    pool.flat.copy_(torch.randn(pool.flat.numel()).to(pool.flat.dtype))
    engine = KVTransferEngine(pool, "127.0.0.1")
    rooms = RoomTable(stale_after_s=60)
    server = BootstrapServer(rooms, "127.0.0.1", 0).start()
    results: dict[str, str | None] = {}
    finished = threading.Event()

    def on_done(rid: str, error: str | None) -> None:
        results[rid] = error
        finished.set()

    # Long enough for a peer process spawned under load to register its room.
    sender = KVSender(engine, PoolDescriptor.of(pool), rooms, LONG_TIMEOUT_S, on_done)
    yield {"pool": pool, "rooms": rooms, "port": server.port, "sender": sender,
           "results": results, "finished": finished}
    sender.close()
    server.close()
    engine.close()


def _start_peer(port: int, room: int, pages: list[int], timeout_s: float) -> tuple[Any, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    peer = context.Process(target=decode_peer_main, args=(port, room, pages, timeout_s, results))
    peer.start()
    return peer, results


def _stop(peer: Any) -> None:
    peer.join(timeout=5)
    if peer.is_alive():
        peer.kill()
        peer.join()


def test_kv_lands_bit_exact_in_another_process(prefill: dict[str, Any]) -> None:
    source_pages = [5, 6, 7, 20, 2]
    peer_pages = [30, 1, 2, 3, 11]  # runs on neither side line up with the other's
    peer, results = _start_peer(prefill["port"], 99, peer_pages, WAIT_S)
    try:
        prefill["sender"].send(SendJob("p", 99, np.asarray(source_pages), first_token=1234,
                                       logprobs=LOGPROBS))
        token, logprobs, error, received = results.get(timeout=WAIT_S)
    finally:
        _stop(peer)
    assert error is None and token == 1234
    assert logprobs == LOGPROBS  # through the bootstrap server's JSON, to the other process
    assert prefill["finished"].wait(WAIT_S) and prefill["results"]["p"] is None
    expected = prefill["pool"].pages[torch.tensor(source_pages)]
    assert np.array_equal(received, expected.view(torch.int16).numpy())
    assert len(prefill["rooms"]) == 0


def test_sender_fails_the_request_when_no_decode_registers(prefill: dict[str, Any]) -> None:
    sender: KVSender = prefill["sender"]
    sender.timeout_s = 0.3
    sender.send(SendJob("lonely", 5, np.asarray([1]), first_token=1))
    assert prefill["finished"].wait(WAIT_S)
    assert "no decode instance registered" in str(prefill["results"]["lonely"])


def test_sender_fails_when_the_decode_engine_is_gone(prefill: dict[str, Any]) -> None:
    # A registration naming a transfer engine nobody runs: the write is refused.
    dead_session = f"127.0.0.1:{free_port()}"
    prefill["rooms"].register(3, Registration(dead_session, PoolDescriptor.of(make_pool()),
                                              np.array([4])))
    began = time.monotonic()
    prefill["sender"].send(SendJob("orphan", 3, np.asarray([1]), first_token=1))
    assert prefill["finished"].wait(WAIT_S)
    assert "KV transfer to the decode instance failed" in str(prefill["results"]["orphan"])
    assert time.monotonic() - began < AT_ONCE_S  # refused, not left to the sender's timeout
    assert prefill["rooms"].status(3, 0).state is RoomState.FAILED


def test_receiver_notices_a_dead_prefill_instance_quickly() -> None:
    got: list[tuple[int | None, str | None]] = []
    done = threading.Event()

    def on_done(rid: str, token: int | None, logprobs: Any, error: str | None) -> None:
        got.append((token, error))
        done.set()

    receiver = KVReceiver("127.0.0.1:1", PoolDescriptor.of(make_pool()), LONG_TIMEOUT_S,
                          on_done)
    began = time.monotonic()
    receiver.receive(ReceiveJob("r", "127.0.0.1", free_port(), 1, np.array([0])))
    assert done.wait(WAIT_S)
    receiver.close()
    assert got[0][0] is None and "unreachable" in str(got[0][1])
    assert UNREACHABLE_GRACE_S <= time.monotonic() - began < UNREACHABLE_GRACE_S + AT_ONCE_S


def test_receiver_times_out(prefill: dict[str, Any]) -> None:
    got: list[str | None] = []
    done = threading.Event()

    def on_done(rid: str, token: int | None, logprobs: Any, error: str | None) -> None:
        got.append(error)
        done.set()

    # The prefill side never computes this room's request: the decode side gives up.
    receiver = KVReceiver("127.0.0.1:1", PoolDescriptor.of(make_pool()), 0.5, on_done)
    receiver.receive(ReceiveJob("r", "127.0.0.1", prefill["port"], 8, np.array([0])))
    assert done.wait(WAIT_S)
    receiver.close()
    assert "timed out" in str(got[0])
    assert prefill["rooms"].status(8, 0).state is RoomState.CANCELLED


def test_closing_ends_waiting_jobs_at_once(prefill: dict[str, Any]) -> None:
    got: list[str | None] = []
    receiver = KVReceiver("127.0.0.1:1", PoolDescriptor.of(make_pool()), LONG_TIMEOUT_S,
                          lambda rid, token, logprobs, error: got.append(error))
    receiver.receive(ReceiveJob("r", "127.0.0.1", prefill["port"], 11, np.array([0])))
    sender: KVSender = prefill["sender"]
    sender.send(SendJob("s", 12, np.asarray([1]), first_token=1))
    # Both jobs are waiting: the receiver registered its room with the prefill side, and the
    # sender's job waits for room 12's registration (the room exists once it does).
    rooms = sender.rooms
    assert wait_until(lambda: rooms.status(11, 0).state is RoomState.REGISTERED
                      and 12 in rooms._rooms)
    began = time.monotonic()
    receiver.close()
    sender.close()
    assert time.monotonic() - began < AT_ONCE_S
    assert got == ["the decode instance shut down"]
    assert prefill["results"]["s"] == "the prefill instance shut down"


def test_a_decode_side_giving_up_fails_the_prefill_request_at_once(
    prefill: dict[str, Any],
) -> None:
    sender: KVSender = prefill["sender"]
    sender.send(SendJob("computed", 21, np.asarray([1]), first_token=1))
    receiver = KVReceiver("127.0.0.1:1", PoolDescriptor.of(make_pool()), LONG_TIMEOUT_S,
                          lambda rid, token, logprobs, error: None)
    began = time.monotonic()
    receiver.give_up("127.0.0.1", prefill["port"], 21)
    assert prefill["finished"].wait(WAIT_S)
    receiver.close()
    assert "gave up" in str(prefill["results"]["computed"])
    assert time.monotonic() - began < AT_ONCE_S
