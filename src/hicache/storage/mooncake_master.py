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

import atexit
import contextlib
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

MASTER_BINARY = "mooncake_master"
DEFAULT_READY_TIMEOUT_S = 15.0
# Attempts at finding free ports: another process may take a port between our
# probe and the master's bind, in which case the master exits and we retry.
_PORT_ATTEMPTS = 5
_LOG_TAIL_BYTES = 4000

_live: set[MasterProcess] = set()
_logs: set[Path] = set()  # log files start_master created, removed at exit at the latest
_live_lock = threading.Lock()


class MasterError(RuntimeError):
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


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Does something accept TCP connections at host:port?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MasterProcess:
    """A running ``mooncake_master``; see the module docstring."""

    def __init__(
        self, binary: Path, host: str, rpc_port: int, metrics_port: int,
        extra_args: Sequence[str], log_path: Path,
    ) -> None:
        self.binary = binary
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """What clients take as ``master_server_address`` (host:port)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
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

    def start(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Launch the process and wait until its RPC port accepts connections."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + ready_timeout
        while not port_open(self.host, self.rpc_port):
            if not self.running:
                code = self._process.returncode
                self._process = None
                raise MasterError(
                    f"{MASTER_BINARY} exited with code {code} at start-up:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise MasterError(
                    f"{MASTER_BINARY} did not listen on {self.address} within "
                    f"{ready_timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        """End the master (SIGTERM, then SIGKILL past ``timeout``); idempotent."""
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
        """End the master at once (SIGKILL), as a crash would; idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._forget()

    def restart(self, ready_timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Start the master again on the same ports (after ``stop`` or ``kill``)."""
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

    def __enter__(self) -> MasterProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
        with _live_lock:
            temporary = self.log_path in _logs
        if temporary:  # a log the caller chose stays
            with contextlib.suppress(OSError):
                self.log_path.unlink()


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
    binary = binary or find_master_binary()
    if log_path is None:
        fd, log_name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        os.close(fd)
        with _live_lock:
            _logs.add(Path(log_name))
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_name = str(log_path)
    attempts = 1 if rpc_port is not None and metrics_port is not None else _PORT_ATTEMPTS
    for attempt in range(attempts):
        master = MasterProcess(
            binary, host, rpc_port or free_port(host), metrics_port or free_port(host),
            extra_args, Path(log_name),
        )
        try:
            master.start(ready_timeout)
            return master
        except MasterError:
            if attempt == attempts - 1:
                if log_path is None:
                    with contextlib.suppress(OSError):
                        os.unlink(log_name)
                raise
    raise AssertionError("unreachable")


@atexit.register
def _stop_forgotten_masters() -> None:
    with _live_lock:
        forgotten = list(_live)
        logs = list(_logs)
    for master in forgotten:
        master.kill()
    for log in logs:
        with contextlib.suppress(OSError):
            log.unlink()
