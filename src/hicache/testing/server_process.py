"""Server programs in child processes on free loopback ports, for benchmarks and tests.

``ChildServer`` runs any command that serves HTTP on a known port through the
launcher (``launcher.ChildProcess``: its own process group, stopped whole on the
way out, so worker processes it spawned or a shell's children go with it); it is
ready once one of its readiness routes answers 200. ``ServerProcess`` is
``hicache serve`` in such a child.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from hicache.net import free_port
from hicache.testing.cpu_limit import CpuLimit
from hicache.testing.launcher import ChildProcess, LaunchError, http_ok


class ServerStartError(LaunchError):
    """The server exited, or did not become healthy in time (the message has its log's tail)."""


class ChildServer(ChildProcess):
    """``command`` in a child process (its own process group) serving on ``port``.

    ``with ChildServer(...) as server:`` starts it and waits until a GET of one of
    ``ready_paths`` answers 200; leaving the block always stops it: SIGTERM to the
    group, then SIGKILL to whatever of the group is left after ``stop_timeout_s``.
    ``cpu_limit`` runs it under ``taskset`` with thread counts set (see cpu_limit.py).
    """

    error: ClassVar[type[LaunchError]] = ServerStartError
    # An HTTP request per check, against a server that may be loading a model.
    poll_interval_s: ClassVar[float] = 0.2

    def __init__(
        self, command: Sequence[str], port: int, log_path: Path, *,
        env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 20.0, ready_paths: Sequence[str] = ("/health",),
        name: str = "the server", cpu_limit: CpuLimit | None = None,
    ) -> None:
        if cpu_limit is not None:
            env = cpu_limit.env(env)
        super().__init__(log_path, env=env, stop_timeout_s=stop_timeout_s)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.command = list(command) if cpu_limit is None else cpu_limit.wrap(command)
        self.startup_timeout_s = startup_timeout_s
        self.ready_paths = tuple(ready_paths)
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def command_line(self) -> list[str]:
        return self.command

    def ready(self) -> bool:
        return http_ok(self.url, self.ready_paths)

    def awaited(self) -> str:
        return f"answer {' or '.join(self.ready_paths)} on port {self.port}"

    def wait_ready(self, ready_timeout: float | None = None) -> None:
        """Wait until a launched server is ready (``ready_timeout`` None: its
        ``startup_timeout_s``); stop it (and raise) if it never is."""
        super().wait_ready(self.startup_timeout_s if ready_timeout is None else ready_timeout)


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
        name: str = "the server",
    ) -> None:
        port = free_port()
        # ``launcher`` replaces the program (tests run a stand-in server); the flags stay.
        program = launcher or [sys.executable, "-m", "hicache", "--log-level", "info", "serve"]
        super().__init__(
            [*program, "--host", "127.0.0.1", "--port", str(port), *args], port, log_path,
            env=env, startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s,
            name=name, cpu_limit=cpu_limit,
        )
