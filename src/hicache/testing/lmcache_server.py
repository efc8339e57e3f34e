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

import os
import shutil
from pathlib import Path

from hicache.net import free_port
from hicache.testing.local_server import (
    PORT_ATTEMPTS,
    LocalServer,
    LocalServerError,
    start_on_free_port,
    temporary_log,
)

SERVER_PROGRAM = "lmcache_server"
PROGRAM_ENV = "HICACHE_LMCACHE_SERVER"
# Where scripts/bootstrap.sh puts LMCache's own environment (repository root).
ENV_DIR = ".venv-lmcache"
INSTALL_HINT = (
    "bash scripts/bootstrap.sh (it creates .venv-lmcache with LMCache's server), or set "
    f"{PROGRAM_ENV} to an {SERVER_PROGRAM} program"
)
DEFAULT_READY_TIMEOUT_S = 30.0


# LMCache's server binds its port without SO_REUSEADDR. Killed while a client
# is connected, it leaves that connection in TIME_WAIT on the server's port for
# a minute, and a restart on the same port fails with "Address already in
# use". The launcher turns the option on for every bind, then runs the
# server's own entry point (its argv: host, port, storage).
_REUSE_ADDRESS_LAUNCHER = """
import socket
_bind = socket.socket.bind
def _bind_reusing_address(self, address):
    self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return _bind(self, address)
socket.socket.bind = _bind_reusing_address
from lmcache.v1.server.__main__ import main
main()
"""


def python_of(program: Path) -> str | None:
    """The interpreter named by ``program``'s ``#!`` line if it is a Python
    script (a console-script entry point), else None."""
    try:
        with open(program, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words:
        return None
    if Path(words[0]).name == "env" and len(words) > 1:
        found = shutil.which(words[1])
        return found if found and "python" in words[1] else None
    return words[0] if "python" in Path(words[0]).name else None


class LMCacheServerError(LocalServerError):
    """The server program is missing, or the server did not come up."""


def find_server_program() -> Path | None:
    """``lmcache_server`` from .venv-lmcache, ``$HICACHE_LMCACHE_SERVER`` or PATH; else None."""
    candidates = []
    configured = os.environ.get(PROGRAM_ENV)
    if configured:
        candidates.append(Path(configured))
    # src/hicache/testing/lmcache_server.py -> the repository root of a source checkout.
    root = Path(__file__).resolve().parents[3]
    candidates.append(root / ENV_DIR / "bin" / SERVER_PROGRAM)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(SERVER_PROGRAM)
    return Path(found) if found else None


class LMCacheServerProcess(LocalServer):
    """A running ``lmcache_server``; see the module docstring."""

    error = LMCacheServerError
    ready_timeout_s = DEFAULT_READY_TIMEOUT_S
    # A Python program that imports much before it listens: no need to poll often.
    poll_interval_s = 0.05

    def __init__(self, program: Path, host: str, port: int, log_path: Path,
                 owned: Path | None = None) -> None:
        super().__init__(host, port, log_path, owned)
        self.program = program

    @property
    def name(self) -> str:
        return SERVER_PROGRAM

    @property
    def url(self) -> str:
        """What the backend takes as ``remote_url``."""
        return f"lm://{self.host}:{self.port}"

    def command_line(self) -> list[str]:
        arguments = [self.host, str(self.port), "cpu"]
        interpreter = python_of(self.program)
        if interpreter is None:
            return [str(self.program), *arguments]
        return [interpreter, "-c", _REUSE_ADDRESS_LAUNCHER, *arguments]

    def close(self) -> None:
        """Kill the server (it keeps nothing worth a clean shutdown) and remove its log."""
        self.kill()
        super().close()


def start_server(
    host: str = "127.0.0.1", program: Path | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
) -> LMCacheServerProcess:
    """A started server on a free port of ``host`` (see the module docstring)."""
    found = program or find_server_program()
    if found is None:
        raise LMCacheServerError(f"{SERVER_PROGRAM} not found: {INSTALL_HINT}")

    def make() -> LMCacheServerProcess:
        log = temporary_log("hicache-lmcache-server-")
        return LMCacheServerProcess(found, host, free_port(host), log, owned=log)

    return start_on_free_port(make, PORT_ATTEMPTS, ready_timeout)
