"""A throwaway store server run as a child process on loopback (tests, benchmarks, trying out).

The launchers of the Mooncake master, Redis/Valkey and LMCache's server all do
the same around their own command line: start the program with its output in a
log file, wait until it answers on its port, end it (gently with ``stop``, as a
crash would with ``kill``), bring it back on the same port with ``restart``, and
make sure no child outlives the interpreter. ``LocalServer`` is that part;
a subclass says how to launch its program and, if a listening port is not
proof enough, how to tell it is ready.

Files a server owns (a temporary log, a working directory) are removed by
``close`` (the ``with`` block's end) or at interpreter exit at the latest; a
log the caller chose is kept.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

# Another process may take a free port between our probe and the server's
# bind; the server then exits and the launcher tries another port.
PORT_ATTEMPTS = 5
_LOG_TAIL_BYTES = 4000
_STOP_TIMEOUT_S = 10.0

_live: set[LocalServer] = set()
_temporary: set[Path] = set()  # files and directories removed at exit at the latest
_lock = threading.Lock()

Server = TypeVar("Server", bound="LocalServer")


class LocalServerError(RuntimeError):
    """A local server's program is missing, or the server did not come up."""


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Does something accept TCP connections at host:port?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def temporary_log(prefix: str) -> Path:
    """A new empty log file, removed at interpreter exit unless ``remove_owned`` did it first."""
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(handle)
    path = Path(name)
    with _lock:
        _temporary.add(path)
    return path


def temporary_dir(prefix: str) -> Path:
    """A new empty directory, removed at interpreter exit unless ``remove_owned`` did it first."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    with _lock:
        _temporary.add(path)
    return path


def remove_owned(path: Path) -> None:
    """Remove a file or directory made by ``temporary_log`` / ``temporary_dir``; idempotent."""
    with _lock:
        _temporary.discard(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class LocalServer(ABC):
    """One server program on ``host:port``, its output appended to ``log_path``.

    ``owned``: a file or directory (from ``temporary_log`` / ``temporary_dir``)
    that ``close`` removes; None when everything belongs to the caller.
    """

    # The error a subclass raises, so its callers catch their own type.
    error: ClassVar[type[LocalServerError]] = LocalServerError
    # How long start() waits for readiness unless told.
    ready_timeout_s: ClassVar[float] = 15.0
    # How often start() checks readiness: a fast check can run often.
    poll_interval_s: ClassVar[float] = 0.02

    def __init__(
        self, host: str, port: int, log_path: Path, owned: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.log_path = log_path
        self.owned = owned
        self.cwd = cwd
        self._process: subprocess.Popen[bytes] | None = None

    @property
    @abstractmethod
    def name(self) -> str:
        """The program's name, for error messages."""

    @abstractmethod
    def command(self) -> list[str]:
        """The command line that runs the server on ``host:port``."""

    def ready(self) -> bool:
        """Does the started server serve yet? By default: its port accepts connections."""
        return port_open(self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, ready_timeout: float | None = None) -> None:
        """Launch the server (if not running) and wait until it is ``ready``
        (``ready_timeout`` None: the class's ``ready_timeout_s``)."""
        if self.running:
            return
        if ready_timeout is None:
            ready_timeout = self.ready_timeout_s
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.cwd,
            )
        with _lock:
            _live.add(self)
        deadline = time.monotonic() + ready_timeout
        while not self.ready():
            if not self.running:
                code = self._process.returncode
                self._forget()
                raise self.error(
                    f"{self.name} exited with code {code} at start-up:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise self.error(
                    f"{self.name} did not answer on {self.host}:{self.port} within "
                    f"{ready_timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval_s)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """End the server (SIGTERM, then SIGKILL past ``timeout``); idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._forget()

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would; idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._forget()

    def restart(self, ready_timeout: float | None = None) -> None:
        """Start the server again on the same port, empty (a running one is killed first)."""
        self.kill()
        self.start(ready_timeout)

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - limit))
                return log.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the server and remove the files it owns."""
        self.stop()
        if self.owned is not None:
            remove_owned(self.owned)

    def _forget(self) -> None:
        self._process = None
        with _lock:
            _live.discard(self)

    def __enter__(self: Server) -> Server:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def start_on_free_port(
    make: Callable[[], Server], attempts: int, ready_timeout: float | None = None
) -> Server:
    """``make()`` a server (on a freshly probed port) and start it, ``attempts`` times at most.

    A server that fails to start is closed (its owned files removed) before the
    next try; the last failure is raised."""
    for attempt in range(attempts):
        server = make()
        try:
            server.start(ready_timeout)
            return server
        except LocalServerError:
            server.close()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@atexit.register
def _end_forgotten_servers() -> None:
    with _lock:
        forgotten = list(_live)
    for server in forgotten:
        server.kill()
    with _lock:
        leftovers = list(_temporary)
    for path in leftovers:
        remove_owned(path)
