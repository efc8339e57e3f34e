"""One program in a child process: start it, wait until it is ready, stop it, read its log.

Every server that tests and benchmarks run beside hicache (a store's server, a
``hicache serve``, a baseline, the router) goes through ``ChildProcess``; a
subclass says only what its command line is and what "ready" means (a port that
accepts connections, an HTTP route that answers 200, a line in its log).

Invariants:

- The child runs in a process group of its own, so ``stop`` and ``kill`` reach
  whatever it spawned (workers, a shell's children) and not this process.
- Its stdout and stderr go to ``log_path``; a failed start raises the class's
  ``error`` with the log's tail, after the child (and its group) has been ended.
- No child outlives the interpreter: any still running at exit is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

DEFAULT_STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 30

_live: set[ChildProcess] = set()
_lock = threading.Lock()

Child = TypeVar("Child", bound="ChildProcess")


class LaunchError(RuntimeError):
    """The program exited, or was not ready in time (the message has its log's tail)."""


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Does something accept TCP connections at host:port?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_ok(base_url: str, paths: Sequence[str], timeout: float = 2.0) -> bool:
    """Does a GET of any of ``paths`` under ``base_url`` answer 200?"""
    for path in paths:
        try:
            with urllib.request.urlopen(f"{base_url}{path}", timeout=timeout) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or no such route (another one may answer)
    return False


class ChildProcess(ABC):
    """A program run as a child with its output in ``log_path``; see the module docstring.

    ``append_log``: each launch appends to the log (a server restarted on the same
    port keeps one log) instead of starting it afresh.
    """

    # The error a subclass raises, so its callers catch their own type.
    error: ClassVar[type[LaunchError]] = LaunchError
    # How long ``start`` waits for readiness unless told.
    ready_timeout_s: ClassVar[float] = 15.0
    # How often ``start`` checks readiness: a cheap check can run often.
    poll_interval_s: ClassVar[float] = 0.02

    def __init__(
        self, log_path: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
        append_log: bool = False, stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        self.log_path = log_path
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.append_log = append_log
        self.stop_timeout_s = stop_timeout_s
        # The last child launched; kept once it has exited, for its pid and exit status.
        self.process: subprocess.Popen[bytes] | None = None
        self._ended = False  # the last child and its group were ended and reaped

    @property
    @abstractmethod
    def name(self) -> str:
        """The program's name, for error messages."""

    @abstractmethod
    def command_line(self) -> list[str]:
        """The command that runs the program."""

    def ready(self) -> bool:
        """Does the launched program serve yet? By default: as soon as it runs."""
        return True

    def awaited(self) -> str:
        """What ``ready`` waits for, as in "did not <awaited> within 10 s"."""
        return "become ready"

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs, else None."""
        return self.process.pid if self.running and self.process is not None else None

    @property
    def running(self) -> bool:
        """Launched and not exited (the group's leader; see ``group_alive`` for the rest)."""
        return self.process is not None and self.process.poll() is None

    @property
    def group_alive(self) -> bool:
        """Is any process of the child's group still there (its leader or a child of it)?"""
        return self.process is not None and not self._ended and _group_alive(self.process.pid)

    def start(self, ready_timeout: float | None = None) -> None:
        """Launch the program (unless it runs) and wait until it is ready."""
        if self.running:
            return
        self.launch()
        self.wait_ready(ready_timeout)

    def launch(self) -> None:
        """Start the program without waiting: several can then come up side by side,
        each awaited with ``wait_ready`` afterwards."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab" if self.append_log else "wb") as log:
            self.process = subprocess.Popen(
                self.command_line(), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True,
            )
        self._ended = False
        with _lock:
            _live.add(self)

    def wait_ready(self, ready_timeout: float | None = None) -> None:
        """Wait until the launched program is ``ready`` (``ready_timeout`` None: the class's
        ``ready_timeout_s``); if it exits or never is, stop it and raise ``error``."""
        timeout = self.ready_timeout_s if ready_timeout is None else ready_timeout
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        process = self.process
        if process is None:
            raise self.error(f"{self.name} was never launched")
        deadline = time.monotonic() + timeout
        while True:
            code = process.poll()
            if code is not None:
                raise self.error(
                    f"{self.name} exited with status {code} before it was ready "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            if self.ready():
                return
            if time.monotonic() > deadline:
                raise self.error(
                    f"{self.name} did not {self.awaited()} within {timeout:g} s, so it was "
                    f"not ready (log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval_s)

    def terminate(self) -> None:
        """Ask the whole group to exit (SIGTERM) without waiting; ``stop`` then waits.
        Several programs told at once shut down side by side."""
        if self.process is not None and not self._ended:
            _signal_group(self.process.pid, signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> int | None:
        """End the program and its group: SIGTERM, then SIGKILL to whatever is left after
        ``timeout`` (None: ``stop_timeout_s``). Idempotent; the exit status."""
        process = self.process
        if process is None or self._ended:
            return None if process is None else process.returncode
        grace = self.stop_timeout_s if timeout is None else timeout
        group = process.pid  # start_new_session: the leader's pid is the group's id
        # Even when the leader is gone already, members of its group may not be.
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
        # Members may outlive their leader: give them what is left of the grace period.
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.kill()

    def kill(self) -> int | None:
        """End the whole group at once (SIGKILL), as a crash would; idempotent."""
        process = self.process
        if process is None or self._ended:
            return None if process is None else process.returncode
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        # Its group is gone: signalling that id again could reach a process that reuses it.
        self._ended = True
        with _lock:
            _live.discard(self)
        return process.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log_text()
        return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"

    def logged(self, text: str) -> bool:
        """Has the program written ``text`` to its log (a readiness line, say)?"""
        return text in self.log_text()

    def __enter__(self: Child) -> Child:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


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


@atexit.register
def end_forgotten_children() -> None:
    """Kill every child still running (at interpreter exit: none may outlive it)."""
    with _lock:
        forgotten = list(_live)
    for child in forgotten:
        child.kill()
