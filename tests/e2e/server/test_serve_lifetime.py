"""``hicache serve`` killed with SIGKILL takes its engine processes along, and starts
again at once on the same ports.

Real servers in child processes (the tiny preset on the CPU), KV events on fixed
loopback ports, and an L3 store that hangs on demand (``tests.stalling_l3``): a
store that does not answer keeps an orphaned engine from finishing its shutdown,
which must not keep the ports, nor the process, for longer than a bounded time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from hicache.net import free_port
from hicache.testing.server_process import ChildServer
from tests.processes import is_gone, spawned_children, start_time
from tests.waiting import wait_until

START_TIMEOUT_S = 120.0  # a cold interpreter imports torch first, on a busy machine
# Well past the engine's own bound on an orphan's shutdown (engine_process.ORPHAN_EXIT_S,
# 5 s), for a loaded machine; well short of the stalls, which last until the test ends.
GONE_WITHIN_S = 30.0
# Kill and restart this many times (the full check: HICACHE_RESTART_LOOPS=20).
RESTART_LOOPS = int(os.environ.get("HICACHE_RESTART_LOOPS", "3"))
TINY = ["--device", "cpu", "--max-total-tokens", "1024", "--model-preset", "tiny"]


def _serve(tmp_path: Path, port: int, flags: Sequence[str], log_name: str) -> ChildServer:
    """``hicache serve`` on ``port``, launched, not awaited (``wait_ready`` does)."""
    server = ChildServer(
        [sys.executable, "-m", "hicache", "serve", "--port", str(port), *TINY, *flags], port,
        tmp_path / log_name, env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
        startup_timeout_s=START_TIMEOUT_S, stop_timeout_s=60.0, name="serve",
    )
    server.launch()
    return server


def _pid(server: ChildServer) -> int:
    assert server.process is not None
    return server.process.pid


def _kill_server_alone(server: ChildServer) -> None:
    """SIGKILL to the server process only: what it spawned must end by itself."""
    assert server.process is not None
    server.process.kill()
    server.process.wait(timeout=30)


def _wait_gone(processes: Sequence[tuple[int, int | None]], what: str) -> None:
    assert wait_until(lambda: all(is_gone(pid, started) for pid, started in processes),
                      GONE_WITHIN_S, poll_s=0.05), f"{what} outlived its server"


def _identities(pids: Sequence[int]) -> list[tuple[int, int | None]]:
    return [(pid, start_time(pid)) for pid in pids]


def _kill_left_over(processes: Sequence[tuple[int, int | None]]) -> None:
    for pid, started in processes:  # only those this test's servers started
        if not is_gone(pid, started):
            os.kill(pid, signal.SIGKILL)


def _stalling_l3(tmp_path: Path, **gates: Path) -> list[str]:
    extra = {"module_path": "tests.stalling_l3", "class_name": "StallingFileBackend",
             "path": str(tmp_path / "l3"), **{name: str(path) for name, path in gates.items()}}
    return ["--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]


@pytest.mark.slow
@pytest.mark.timeout(120 + 90 * RESTART_LOOPS)
def test_kill_9_then_restart_at_once_on_the_same_ports(tmp_path: Path) -> None:
    """Each time: the server answers, is killed with SIGKILL while its engine's store would
    hang its shutdown, and a new server on the same HTTP and KV event ports, started at
    once, comes up and answers; the old engine process ends within a bounded time."""
    port, events_port, replay_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    close_gate = tmp_path / "close-gate"
    close_gate.touch()  # every store's close hangs until the end of the test
    flags = ["--kv-events-config", json.dumps(events), *_stalling_l3(tmp_path,
                                                                     close_gate=close_gate)]
    engines: list[tuple[int, int | None]] = []
    server = _serve(tmp_path, port, flags, "serve-0.log")
    try:
        server.wait_ready()
        for loop in range(1, RESTART_LOOPS + 1):
            reply = httpx.post(f"{url}/generate", timeout=60.0, json={
                "input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 3}})
            assert reply.status_code == 200, reply.text
            info = httpx.get(f"{url}/get_server_info", timeout=30.0).json()
            assert info["kv_events_endpoint"] == events["endpoint"]
            ours = _identities(spawned_children(_pid(server)))
            assert len(ours) == 1, ours
            engines += ours
            _kill_server_alone(server)
            server = _serve(tmp_path, port, flags, f"serve-{loop}.log")  # at once
            server.wait_ready()
            _wait_gone(ours, "the engine process")
        reply = httpx.post(f"{url}/generate", timeout=60.0, json={
            "input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 3}})
        assert reply.status_code == 200, reply.text
    finally:
        close_gate.unlink()
        server.stop()
        _kill_left_over(engines)
    log = (tmp_path / "serve-1.log").read_text()
    assert "cannot bind the KV event sockets" not in log


@pytest.mark.slow
def test_killed_while_its_ranks_are_starting_they_end_too(tmp_path: Path) -> None:
    """Both tensor-parallel ranks hang in their store's attach (the engine is not built,
    nothing reads the pipe): SIGKILL of the server ends them all the same."""
    attach_gate = tmp_path / "attach-gate"
    attach_gate.touch()
    flags = ["--tp-size", "2", *_stalling_l3(tmp_path, attach_gate=attach_gate)]
    server = _serve(tmp_path, free_port(), flags, "serve.log")
    ranks: list[tuple[int, int | None]] = []
    try:

        def both_inside_attach() -> bool:
            assert server.running, server.log_text()
            return len(list(tmp_path.glob("attach-gate.*"))) >= 2

        assert wait_until(both_inside_attach, START_TIMEOUT_S, poll_s=0.1), (
            (tmp_path / "serve.log").read_text()
        )
        pids = sorted(int(marker.suffix[1:]) for marker in tmp_path.glob("attach-gate.*"))
        assert sorted(spawned_children(_pid(server))) == pids
        ranks = _identities(pids)
        _kill_server_alone(server)
        _wait_gone(ranks, "a rank stuck in its build")
    finally:
        attach_gate.unlink()
        server.stop()
        _kill_left_over(ranks)
