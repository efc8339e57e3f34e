"""A throwaway store server run as a child process on loopback (tests, benchmarks, trying out).

The Mooncake master, Redis/Valkey and LMCache's server are launched alike:
``LocalServer`` is the launcher (``launcher.ChildProcess``) given a host and a
port, ready once the port accepts connections unless a subclass knows better,
with ``restart`` bringing a killed server back on the same port and
``start_on_free_port`` retrying on another port when the probed one was taken.

Files a server owns (a temporary log, a working directory) are removed by
``close`` (the ``with`` block's end) or at interpreter exit at the latest; a
log the caller chose is kept.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

from hicache.testing.launcher import ChildProcess, LaunchError, end_forgotten_children, port_open

# Another process may take a free port between our probe and the server's
# bind; the server then exits and the launcher tries another port.
PORT_ATTEMPTS = 5

_temporary: set[Path] = set()  # files and directories removed at exit at the latest
_lock = threading.Lock()

Server = TypeVar("Server", bound="LocalServer")


class LocalServerError(LaunchError):
    """A local server's program is missing, or the server did not come up."""


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


class LocalServer(ChildProcess):
    """One server program on ``host:port``, its output appended to ``log_path``.

    ``owned``: a file or directory (from ``temporary_log`` / ``temporary_dir``)
    that ``close`` removes; None when everything belongs to the caller.
    """

    error: ClassVar[type[LaunchError]] = LocalServerError

    def __init__(
        self, host: str, port: int, log_path: Path, owned: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        # Appended: a restarted server keeps the log of its earlier runs.
        super().__init__(log_path, cwd=cwd, append_log=True)
        self.host = host
        self.port = port
        self.owned = owned

    def ready(self) -> bool:
        """By default: its port accepts connections."""
        return port_open(self.host, self.port)

    def awaited(self) -> str:
        return f"answer on {self.host}:{self.port}"

    def restart(self, ready_timeout: float | None = None) -> None:
        """Start the server again on the same port, empty (a running one is killed first)."""
        self.kill()
        self.start(ready_timeout)

    def close(self) -> None:
        """Stop the server and remove the files it owns."""
        self.stop()
        if self.owned is not None:
            remove_owned(self.owned)

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
        except LaunchError:
            server.close()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@atexit.register
def _remove_leftovers() -> None:
    # Exit hooks run last-registered first: this one precedes the launcher's, so it ends
    # the servers itself before removing their working directories.
    end_forgotten_children()
    with _lock:
        leftovers = list(_temporary)
    for path in leftovers:
        remove_owned(path)
