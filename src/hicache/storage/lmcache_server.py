"""Start and stop a local ``lmcache_server`` (tests, the storage benchmark, trying it out).

LMCache pins its own versions of numpy and much else, so it does not go into
hicache's environment: ``scripts/bootstrap.sh`` installs it into a separate
one, ``.venv-lmcache`` at the repository root, used only to run the server.
``find_server_program`` looks for the program there, then at
``$HICACHE_LMCACHE_SERVER``, then on ``PATH``::

    with start_server() as server:
        extra = {"remote_url": server.url}
        ...

The server listens on ``host`` (127.0.0.1 unless told otherwise) on a free
port; it is killed when the ``with`` block ends, when ``kill`` is called, or
at interpreter exit. ``restart`` brings a killed server back on the same port
(with an empty store: it keeps values only in memory).
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
from pathlib import Path
from types import TracebackType

from hicache.net import free_port

SERVER_PROGRAM = "lmcache_server"
PROGRAM_ENV = "HICACHE_LMCACHE_SERVER"
# Where scripts/bootstrap.sh puts LMCache's own environment (repository root).
ENV_DIR = ".venv-lmcache"
INSTALL_HINT = (
    "bash scripts/bootstrap.sh (it creates .venv-lmcache with LMCache's server), or set "
    f"{PROGRAM_ENV} to an {SERVER_PROGRAM} program"
)
DEFAULT_READY_TIMEOUT_S = 30.0
_PORT_ATTEMPTS = 5
_LOG_TAIL_BYTES = 4000

_live: set[ServerProcess] = set()
_live_lock = threading.Lock()


class ServerError(RuntimeError):
    """The server program is missing, or the server did not come up."""


def find_server_program() -> Path | None:
    """``lmcache_server`` from .venv-lmcache, ``$HICACHE_LMCACHE_SERVER`` or PATH; else None."""
    candidates = []
    configured = os.environ.get(PROGRAM_ENV)
    if configured:
        candidates.append(Path(configured))
    # src/hicache/storage/lmcache_server.py -> the repository root of a source checkout.
    root = Path(__file__).resolve().parents[3]
    candidates.append(root / ENV_DIR / "bin" / SERVER_PROGRAM)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(SERVER_PROGRAM)
    return Path(found) if found else None


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ServerProcess:
    """A running ``lmcache_server``; see the module docstring."""

    def __init__(self, program: Path, host: str, port: int, log_path: Path) -> None:
        self.program = program
        self.host = host
        self.port = port
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """What the backend takes as ``remote_url``."""
        return f"lm://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Launch the server and wait until its port accepts connections."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [str(self.program), self.host, str(self.port), "cpu"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + ready_timeout
        while not port_open(self.host, self.port):
            if not self.running:
                code = self._process.returncode
                self._process = None
                raise ServerError(
                    f"{SERVER_PROGRAM} exited with code {code} at start-up:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(
                    f"{SERVER_PROGRAM} did not listen on {self.host}:{self.port} within "
                    f"{ready_timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)
        with _live_lock:
            _live.discard(self)

    def restart(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        self.kill()
        self.start(ready_timeout)

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-_LOG_TAIL_BYTES:]
        except OSError:
            return "(no log)"
        return data.decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.kill()
        self.log_path.unlink(missing_ok=True)


def start_server(
    host: str = "127.0.0.1", program: Path | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
) -> ServerProcess:
    """A started server on a free port of ``host`` (see the module docstring)."""
    program = program or find_server_program()
    if program is None:
        raise ServerError(f"{SERVER_PROGRAM} not found: {INSTALL_HINT}")
    handle, name = tempfile.mkstemp(prefix="hicache-lmcache-server-", suffix=".log")
    os.close(handle)
    log_path = Path(name)
    error: ServerError | None = None
    for _ in range(_PORT_ATTEMPTS):  # another process may take the port before the server
        server = ServerProcess(program, host, free_port(host), log_path)
        try:
            server.start(ready_timeout)
            return server
        except ServerError as failed:
            error = failed
    log_path.unlink(missing_ok=True)
    assert error is not None
    raise error


@atexit.register
def _kill_leftovers() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.kill()
