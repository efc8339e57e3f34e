"""Start and stop a local ``mooncake_master`` (tests, the storage benchmark, trying Mooncake out).

A Mooncake Store cluster needs one master: the process that knows which
object lives in which client's memory segment. For a single machine this
module runs one on loopback, on free ports, with its log in a temporary file
(``log_tail`` shows its end; the file is removed when the ``with`` block ends,
or at interpreter exit)::

    with start_master() as master:
        extra = {"master_server_address": master.address}
        ...

Both of the master's listeners (its RPC port and its HTTP metrics/admin port)
are bound to ``host`` (127.0.0.1 unless told otherwise), and the process is
ended when the ``MasterProcess`` is stopped, when its ``with`` block ends, or
at interpreter exit if a caller forgot. ``restart`` brings a stopped master
back on the same ports: clients reconnect to it on their own (with an empty
store, since the master held the object index in memory).

The binary ships with the ``mooncake-transfer-engine`` wheels, inside the
``mooncake`` package; a ``mooncake_master`` on ``PATH`` is used otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from hicache.net import free_port
from hicache.testing.local_server import (
    PORT_ATTEMPTS,
    LocalServer,
    LocalServerError,
    start_on_free_port,
    temporary_log,
)

MASTER_BINARY = "mooncake_master"
DEFAULT_READY_TIMEOUT_S = 15.0


class MasterError(LocalServerError):
    """The master binary is missing, or the master did not come up."""


def find_master_binary() -> Path:
    """The ``mooncake_master`` executable: the one in the ``mooncake`` package, else on PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / MASTER_BINARY
            if candidate.is_file():
                if not os.access(candidate, os.X_OK):
                    # Wheels have been published without the executable bit.
                    with contextlib.suppress(OSError):
                        candidate.chmod(candidate.stat().st_mode | 0o111)
                if os.access(candidate, os.X_OK):
                    return candidate
    found = shutil.which(MASTER_BINARY)
    if found:
        return Path(found)
    raise MasterError(
        f"{MASTER_BINARY} not found: it comes with pip install mooncake-transfer-engine-non-cuda "
        "(or mooncake-transfer-engine), inside the mooncake package"
    )


class MasterProcess(LocalServer):
    """A running ``mooncake_master``; see the module docstring. Its ``port`` is the RPC port."""

    error = MasterError
    ready_timeout_s = DEFAULT_READY_TIMEOUT_S

    def __init__(
        self, binary: Path, host: str, rpc_port: int, metrics_port: int,
        extra_args: Sequence[str], log_path: Path, owned: Path | None = None,
    ) -> None:
        super().__init__(host, rpc_port, log_path, owned)
        self.binary = binary
        self.metrics_port = metrics_port
        self.extra_args = list(extra_args)

    @property
    def name(self) -> str:
        return MASTER_BINARY

    @property
    def rpc_port(self) -> int:
        return self.port

    @property
    def address(self) -> str:
        """What clients take as ``master_server_address`` (host:port)."""
        return f"{self.host}:{self.rpc_port}"

    def command_line(self) -> list[str]:
        return [
            str(self.binary),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--logtostderr",
            *self.extra_args,
        ]


def start_master(
    host: str = "127.0.0.1",
    rpc_port: int | None = None,
    metrics_port: int | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    binary: Path | None = None,
    log_path: Path | None = None,
) -> MasterProcess:
    """Run a master on ``host``; ports left None are picked free (retried if taken meanwhile).

    ``log_path``: where its output goes, kept afterwards (default: a temporary file,
    removed with the master's ``with`` block)."""
    found = binary or find_master_binary()
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)

    def make() -> MasterProcess:
        log = log_path or temporary_log("mooncake-master-")
        return MasterProcess(
            found, host, rpc_port or free_port(host), metrics_port or free_port(host),
            extra_args, log, owned=None if log_path else log,
        )

    attempts = 1 if rpc_port is not None and metrics_port is not None else PORT_ATTEMPTS
    return start_on_free_port(make, attempts, ready_timeout)
