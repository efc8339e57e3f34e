"""LocalServer: start until ready, stop, kill, restart on the same port, owned files, retries.

The program is a tiny Python TCP listener, so these run without any store installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hicache.net import free_port
from hicache.testing.local_server import (
    LocalServer,
    LocalServerError,
    port_open,
    start_on_free_port,
    temporary_dir,
    temporary_log,
)

_LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print('listening', flush=True)\n"
    "time.sleep(60)\n"
)


class Listener(LocalServer):
    ready_timeout_s = 60.0  # a guard: the listener starts in well under a second

    def __init__(self, port: int, log_path: Path, owned: Path | None = None,
                 script: str = _LISTENER) -> None:
        super().__init__("127.0.0.1", port, log_path, owned)
        self.script = script

    @property
    def name(self) -> str:
        return "listener"

    def command_line(self) -> list[str]:
        return [sys.executable, "-c", self.script, self.host, str(self.port)]


def test_start_waits_for_the_port_and_stop_frees_it(tmp_path: Path) -> None:
    with Listener(free_port(), tmp_path / "listener.log") as server:
        server.start()
        assert server.running and server.pid is not None
        assert port_open(server.host, server.port)
        assert "listening" in server.log_tail()
        server.stop()
        assert not server.running and server.pid is None
        assert not port_open(server.host, server.port)
        server.stop()  # idempotent
    assert (tmp_path / "listener.log").is_file()  # not owned: the caller's log stays


def test_restart_comes_back_on_the_same_port_after_a_kill(tmp_path: Path) -> None:
    with Listener(free_port(), tmp_path / "listener.log") as server:
        server.start()
        first = server.pid
        server.kill()
        assert not server.running
        server.restart()
        assert server.running and server.pid != first
        assert port_open(server.host, server.port)
        running = server.pid
        server.restart()  # a running server is replaced by a fresh one
        assert server.running and server.pid != running


def test_close_removes_owned_files() -> None:
    log = temporary_log("hicache-test-listener-")
    with Listener(free_port(), log, owned=log) as server:
        server.start()
    assert not log.exists()
    assert not server.running

    work_dir = temporary_dir("hicache-test-listener-")
    with Listener(free_port(), work_dir / "server.log", owned=work_dir) as server:
        server.start()
    assert not work_dir.exists()


def test_a_program_that_exits_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    failing = "import sys; print('no luck today'); sys.exit(3)"
    server = Listener(free_port(), tmp_path / "listener.log", script=failing)
    with pytest.raises(LocalServerError, match=r"(?s)listener exited with status 3.*no luck"):
        server.start()
    assert not server.running


def test_start_on_free_port_retries_and_cleans_up_each_failure(tmp_path: Path) -> None:
    made: list[Listener] = []

    def make() -> Listener:
        log = temporary_log("hicache-test-listener-")
        # The first two exit at start-up, as a server whose port was taken meanwhile.
        script = _LISTENER if len(made) >= 2 else "raise SystemExit(1)"
        made.append(Listener(free_port(), log, owned=log, script=script))
        return made[-1]

    with start_on_free_port(make, attempts=3) as server:
        assert server is made[2] and server.running
        assert not made[0].log_path.exists() and not made[1].log_path.exists()

    made.clear()
    with pytest.raises(LocalServerError, match="exited with status 1"):
        start_on_free_port(make, attempts=2)
    assert len(made) == 2 and not any(m.log_path.exists() for m in made)
