"""HierarchicalCache with L3 on a real Mooncake Store: hits, sharing across processes, damage.

Every request goes through the KV oracle: KV that came back from Mooncake must
equal cold KV bit for bit.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from hicache.config import MemLayout
from hicache.net import free_port
from hicache.storage.backends.mooncake.backend import MooncakeBackend
from hicache.storage.frame import PayloadOrder, object_name
from hicache.testing.mooncake_master import MasterProcess
from tests.kv_oracle import serve
from tests.mooncake_fixtures import (  # noqa: F401 - fixtures, used by name
    CLIENT_SIZES,
    anchor_fixture,
    conversation,
    extra_fixture,
    make_cache,
    master_fixture,
    serve_with_l3,
    settle,
)

ROOT = Path(__file__).resolve().parents[3]
PEER_TIMEOUT_S = 60.0


@pytest.mark.parametrize("layout", list(MemLayout))
def test_kv_from_an_l3_hit_equals_cold_kv(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend, layout: MemLayout
) -> None:
    tokens = conversation(48, seed=10 + len(layout.value))
    first = make_cache(mooncake_extra, layout=layout)
    second = make_cache(mooncake_extra, layout=layout)
    try:
        assert first.storage is not None and second.storage is not None
        assert serve_with_l3(first, tokens) == 0
        settle(first)
        assert first.stats.num_storage_backed_up_pages == 12
        # Nothing local in the second cache: all 48 tokens come from Mooncake and
        # serve() checks them against cold KV.
        assert serve_with_l3(second, tokens) == 48
        assert second.stats.num_storage_hit_tokens == 48
        settle(second)
        assert second.stats.num_storage_backed_up_pages == 0
        assert second.storage.backend.stats().failures == {}
    finally:
        first.close()
        second.close()


def test_a_corrupted_object_is_detected_and_its_pages_recomputed(
    mooncake_extra: dict[str, Any], mooncake_anchor: MooncakeBackend
) -> None:
    tokens = conversation(40, seed=3)
    first = make_cache(mooncake_extra)
    second = make_cache(mooncake_extra)
    try:
        serve_with_l3(first, tokens)
        settle(first)
        keys = first.tree.page_keys(first.tree.match_prefix(tokens).last_node)
        name = object_name(keys[6], PayloadOrder.TOKEN_MAJOR)
        raw = mooncake_anchor.raw_store
        data = bytearray(raw.get(name))
        data[3] ^= 0x01  # one bit of page 6's first row (objects are payload || header)
        assert raw.remove(name, True) == 0 and raw.put(name, bytes(data)) == 0
        # Pages 0..5 come from Mooncake, page 6 fails its checksum, the rest is
        # recomputed, and the served KV is still cold KV.
        assert serve_with_l3(second, tokens) == 24
        settle(second)
        assert second.storage is not None
        assert second.storage.backend.stats().failures == {"corrupt": 1}
        # The bad object was dropped and the second cache's backup replaced it.
        third = make_cache(mooncake_extra)
        try:
            assert serve_with_l3(third, tokens) == 40
            settle(third)
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_an_unreachable_master_leaves_the_cache_running_without_l3() -> None:
    port = free_port()  # nothing listens there
    began = time.monotonic()
    cache = make_cache({"master_server_address": f"127.0.0.1:{port}", **CLIENT_SIZES})
    try:
        # At once: the library alone retries an unreachable master for over a minute.
        assert time.monotonic() - began < 20.0
        assert cache.storage is None
        assert cache.storage_error is not None
        assert f"127.0.0.1:{port} is unreachable" in cache.storage_error
        assert cache.prefetch(conversation(40)) is None
        assert serve(cache, conversation(40)) == 0
        assert serve(cache, conversation(40)) == 40  # the local tiers work as usual
        settle(cache)
    finally:
        cache.close()


# ------------------------------------------------------------------ two processes
class Peer:
    """A cache in another process on the same master (``tests.mooncake_fixtures.peer_main``)."""

    def __init__(self, master: MasterProcess) -> None:
        # The repo first; whatever the parent's PYTHONPATH holds (a private site folder) after.
        path = [str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tests.mooncake_fixtures import peer_main; peer_main()",
             master.address],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )
        assert self.read() == {"ready": True}

    def read(self) -> dict[str, Any]:
        """The peer's next answer (one line), waiting at most PEER_TIMEOUT_S."""
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], PEER_TIMEOUT_S)
        if not ready:
            self.process.kill()
            pytest.fail(f"the peer process did not answer within {PEER_TIMEOUT_S:.0f} s")
        line = stdout.readline()
        assert line, f"the peer process exited with code {self.process.wait(5)}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def serve(self, seed: int, n: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"serve {seed} {n}\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
                self.process.wait(PEER_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def test_two_processes_on_one_master_hit_each_others_pages(
    mooncake_master: MasterProcess, mooncake_extra: dict[str, Any],
    mooncake_anchor: MooncakeBackend,
) -> None:
    peer = Peer(mooncake_master)
    local = make_cache(mooncake_extra)
    try:
        # The peer computes and backs up a conversation; this process hits all of it.
        answer = peer.serve(seed=21, n=40)
        assert answer["hit"] == 0 and answer["backed_up"] == 10
        assert serve_with_l3(local, conversation(40, seed=21)) == 40
        assert local.stats.num_storage_hit_tokens == 40
        settle(local)
        # And the other way round.
        assert serve_with_l3(local, conversation(32, seed=22)) == 0
        settle(local)
        assert local.stats.num_storage_backed_up_pages == 8
        answer = peer.serve(seed=22, n=32)
        assert answer["hit"] == 32 and answer["storage_hit"] == 32
        assert answer["backed_up"] == 10  # nothing new: the pages were already there
    finally:
        local.close()
        peer.close()
    assert peer.process.returncode == 0
