"""Server programs in child processes on free loopback ports, for benchmarks and tests.

``ChildServer`` runs any command that serves HTTP on a known port: it starts the
command in a process group of its own, waits until one of its readiness routes
answers 200, and stops the whole group on the way out, so that worker processes
the server spawned (or a shell's children) go with it. ``ServerProcess`` is
``hicache serve`` in such a child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from hicache.bench.cpu_limit import CpuLimit
from hicache.net import free_port


class ServerStartError(RuntimeError):
    """The server exited, or did not become healthy in time (the message has its log's tail)."""


class ChildServer:
    """``command`` in a child process (its own process group) serving on ``port``.

    ``with ChildServer(...) as server:`` starts it and waits until a GET of one of
    ``ready_paths`` answers 200; leaving the block always stops it: SIGTERM to the
    group, then SIGKILL to whatever of the group is left after ``stop_timeout_s``.
    ``cpu_limit`` runs it under ``taskset`` with thread counts set (see cpu_limit.py).
    """

    def __init__(
        self, command: Sequence[str], port: int, log_path: Path, *,
        env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 20.0, ready_paths: Sequence[str] = ("/health",),
        name: str = "the server", cpu_limit: CpuLimit | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.command = list(command) if cpu_limit is None else cpu_limit.wrap(command)
        self.log_path = log_path
        if cpu_limit is not None:
            env = cpu_limit.env(env)
        self.env = None if env is None else dict(env)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.ready_paths = tuple(ready_paths)
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ChildServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the command and wait until it is ready (stopped again if it never is)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the command without waiting for it: several servers can then come up
        side by side, each awaited with ``wait_ready`` afterwards."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )

    def wait_ready(self) -> None:
        """Wait until a launched server is ready; stop it (and raise) if it never is."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def running(self) -> bool:
        """Launched and not exited (its leader; see ``group_alive`` for the rest)."""
        return self.process is not None and self.process.poll() is None

    @property
    def group_alive(self) -> bool:
        """Is any process of the server's group still there (its leader or a child)?"""
        return self.process is not None and _group_alive(self.process.pid)

    def terminate(self) -> None:
        """Ask the whole group to exit (SIGTERM) without waiting; ``stop`` then waits.
        Several servers told at once shut down side by side."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGTERM)

    def kill(self) -> None:
        """End the whole group at once (SIGKILL), as a crash would; idempotent."""
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _ready(self) -> bool:
        for path in self.ready_paths:
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or no such route (another one may answer)
        return False

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        routes = " or ".join(self.ready_paths)
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with status {code} before it was ready "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer {routes} on port {self.port} within "
                    f"{self.startup_timeout_s:g} s, so it was not ready "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> int | None:
        """Stop the server and its process group (idempotent); the exit status."""
        process = self.process
        if process is None:
            return None
        group = process.pid  # start_new_session: the leader's pid is the group's id
        # Even when the leader is gone already, members of its group may not be.
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(self.stop_timeout_s)
        # Members of the group may outlive its leader (workers, a shell's children):
        # give them what is left of the grace period, then kill what remains.
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(group, signal.SIGKILL)
        process.wait()
        return process.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:]) or "(the server log is empty)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerProcess(ChildServer):
    """``hicache serve`` in a child process on a free loopback port.

    ``with ServerProcess(args, log) as server:`` starts it and waits for
    /health; leaving the block always stops it (SIGTERM, then SIGKILL if it
    has not exited within ``stop_timeout_s``).
    """

    def __init__(
        self, args: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0, stop_timeout_s: float = 20.0,
        launcher: Sequence[str] | None = None, cpu_limit: CpuLimit | None = None,
    ) -> None:
        port = free_port()
        # ``launcher`` replaces the program (tests run a stand-in server); the flags stay.
        program = launcher or [sys.executable, "-m", "hicache", "--log-level", "info", "serve"]
        super().__init__(
            [*program, "--host", "127.0.0.1", "--port", str(port), *args], port, log_path,
            env=env, startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s,
            name="the server", cpu_limit=cpu_limit,
        )

    def __enter__(self) -> ServerProcess:
        self.start()
        return self
