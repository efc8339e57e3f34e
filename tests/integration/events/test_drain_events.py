"""The drain's KV events, read by a real subscriber: the pages a drain stores in L3 are
announced as any backup's (the host copy, then the EXTERNAL store), hottest first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.events.messages import MEDIUM_CPU, MEDIUM_EXTERNAL, MEDIUM_GPU
from tests.engine_helpers import engine_config, run
from tests.integration.events.test_engine_events import P1, PAGE, TOPIC, EventReader, stored
from tests.waiting import wait_until

# No page shared with P1: its own root-level prefix.
P3 = [71, 72, 73, 74, 81, 82, 83, 84, 90]


@pytest.fixture(name="engine")
def engine_fixture(tmp_path: Path) -> Iterator[Engine]:
    """write_back: pages stay on the device until evicted, so only a drain writes them."""
    events = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
              "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    engine = build_engine(engine_config(
        "--page-size", str(PAGE), "--max-total-tokens", "256",
        "--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp_path / "l3")}),
        "--kv-events-config", json.dumps(events),
    ))
    yield engine
    engine.shutdown()


def test_the_pages_a_drain_stores_are_announced_as_external(engine: Engine) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        reader = EventReader(context, engine)
        run(engine, P1, max_new_tokens=1)
        run(engine, P3, max_new_tokens=1)  # the hotter one
        assert reader.take(2) == [stored(P1, 0, 3, MEDIUM_GPU), stored(P3, 0, 2, MEDIUM_GPU)]
        assert engine.l3_lacking_pages() == 5
        last: list[dict[str, Any]] = []

        def drained() -> bool:
            last[:] = [engine.drain_l3_step()]
            return bool(last[0]["done"])

        assert wait_until(drained), f"the drain did not end: {last}"

        assert last[0]["pages_written"] == 5 and last[0]["pages_to_write"] == 5
        events = reader.take(4)
        # Per tier hottest first, each page's L3 store after its host copy; how the two
        # tiers' events interleave depends on when the copies land.
        for medium in (MEDIUM_CPU, MEDIUM_EXTERNAL):
            assert [e for e in events if getattr(e, "medium", None) == medium] == [
                stored(P3, 0, 2, medium), stored(P1, 0, 3, medium)]
        for prompt, pages in ((P3, 2), (P1, 3)):
            copied = events.index(stored(prompt, 0, pages, MEDIUM_CPU))
            assert copied < events.index(stored(prompt, 0, pages, MEDIUM_EXTERNAL))
        assert engine.l3_lacking_pages() == 0
    finally:
        context.destroy(linger=0)
