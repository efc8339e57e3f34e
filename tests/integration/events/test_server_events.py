"""/get_server_info tells a router where the events are and how this worker names L3 pages.

A served worker with events on and a file L3: the endpoints it reports are the
ones it bound (a replay answers there), and the L3 objects of a request's pages
are found under the names a router computes from the token ids, the reported
seed and order alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import zmq

from hicache.events.messages import REPLAY_END_SEQUENCE, decode_batch, decode_sequence
from hicache.events.messages import encode_sequence as sequence_bytes
from hicache.radix.keys import chain_page_keys, pack_tokens
from hicache.storage.frame import PayloadOrder, object_name
from tests.server_fixtures import serve_in_thread

PAGE = 16  # the test servers' page size
TOPIC = "kv-events"


def test_server_info_reports_the_event_endpoints_and_the_l3_naming(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    events = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    args = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"path": str(l3)}),
            "--kv-events-config", json.dumps(events)]
    ids = [(7 * i) % 200 for i in range(3 * PAGE + 5)]
    with serve_in_thread(args) as server:
        response = httpx.post(f"{server.url}/generate", timeout=60.0, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
        assert response.status_code == 200, response.text
        assert httpx.post(f"{server.url}/flush_cache", timeout=60.0).status_code == 200
        info = httpx.get(f"{server.url}/get_server_info", timeout=30.0).json()

        publisher = server.engine.event_publisher
        assert publisher is not None
        assert info["kv_events_endpoint"] == publisher.endpoint
        assert info["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
        assert not info["kv_events_endpoint"].endswith(":*")
        assert info["kv_events_replay_endpoint"] == publisher.replay_endpoint
        assert info["kv_events_topic"] == TOPIC
        assert json.loads(info["kv_events_config"]) == events

        # The replay endpoint answers: everything since sequence 0, ending in a flush.
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(info["kv_events_replay_endpoint"])
            dealer.send_multipart((b"", sequence_bytes(0)))
            payloads = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, raw, payload = dealer.recv_multipart()
                if decode_sequence(raw) == REPLAY_END_SEQUENCE:
                    break
                payloads.append(payload)
        finally:
            context.destroy(linger=0)
        kinds = [type(e).__name__ for p in payloads for e in decode_batch(p).events]
        assert kinds[0] == "BlockStored" and kinds[-1] == "AllBlocksCleared"

    # A router's computation: keys from the token ids and the seed, names from the order.
    seed = bytes.fromhex(info["hicache_l3_key_seed"])
    order = PayloadOrder.of_tag(info["hicache_l3_object_order"])
    whole = len(ids) // PAGE * PAGE
    keys = chain_page_keys(pack_tokens(ids[:whole]), PAGE, seed)
    names = [object_name(key, order) for key in keys]
    assert len(names) == 3
    for name in names:
        assert (l3 / name[:2] / name).is_file(), f"no L3 object {name}"


def test_an_unknown_order_tag_is_refused() -> None:
    assert PayloadOrder.of_tag("tm") is PayloadOrder.TOKEN_MAJOR
    try:
        PayloadOrder.of_tag("xx")
    except ValueError as error:
        assert "expected lm or tm" in str(error)
    else:
        raise AssertionError("an unknown tag was accepted")
