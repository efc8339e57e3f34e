"""The Mooncake Store client of a process: set up once per settings, shared, and watched.

A client owns a memory segment lent to the pool, a transfer engine and its
listeners, and takes a second or two to close, so backends with equal settings
share one (reference counted). Each client has a watcher thread that probes the
master every ``WATCH_INTERVAL_S``: while the master does not accept connections,
or from the moment a call reports an RPC failure, ``usable()`` is False and
callers fail at once instead of entering a library that retries for seconds.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

from mooncake.store import MooncakeDistributedStore

from hicache.storage.backends.mooncake.settings import MooncakeSettings
from hicache.storage.base import StorageError, StorageUnavailableError
from hicache.storage.failure_reasons import FailureReason

logger = logging.getLogger(__name__)

# Seconds a TCP connect to the master may take before it counts as unreachable.
PROBE_TIMEOUT_S = 0.25
# How often each client checks that its master accepts connections.
WATCH_INTERVAL_S = 0.5
_REQUIRED_METHODS = (
    "batch_put_from_multi_buffers", "batch_get_into_multi_buffers", "batch_is_exist",
    "register_buffer", "unregister_buffer", "remove", "remove_by_regex", "get_size",
)

# Mooncake Store error codes (its ErrorCode enum) this backend tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
_REASONS: dict[int, FailureReason] = {
    -10: FailureReason.NO_SPACE,  # BUFFER_OVERFLOW
    -101: FailureReason.NO_SPACE,  # SEGMENT_NOT_FOUND: no segment mounted (yet) to put into
    # CLIENT_NOT_FOUND: a restarted master does not know us yet
    -103: FailureReason.UNREACHABLE,
    -200: FailureReason.NO_SPACE,  # NO_AVAILABLE_HANDLE: the pool is full
    -500: FailureReason.IO_ERROR,  # WRITE_FAIL
    -701: FailureReason.IO_ERROR,  # INVALID_READ
    # REPLICA_IS_NOT_READY: another instance is still writing it
    -703: FailureReason.NOT_READY,
    OBJECT_NOT_FOUND: FailureReason.MISSING,
    -707: FailureReason.IO_ERROR,  # LEASE_EXPIRED during the transfer
    -710: FailureReason.MISSING,  # REPLICA_NOT_FOUND
    -712: FailureReason.MISSING,  # REPLICA_IS_GONE
    -800: FailureReason.IO_ERROR,  # TRANSFER_FAIL
    RPC_FAIL: FailureReason.UNREACHABLE,
    -1010: FailureReason.UNREACHABLE,  # UNAVAILABLE_IN_CURRENT_STATUS (master not serving)
}


_unnamed_codes_seen: set[int] = set()


def failure_reason(code: int) -> FailureReason:
    """The stats reason for a Mooncake error code; a code not in ``_REASONS`` is a
    "store_error" (a bounded label), its number logged the first time it is seen."""
    reason = _REASONS.get(code)
    if reason is None:
        if code not in _unnamed_codes_seen:
            _unnamed_codes_seen.add(code)
            logger.warning("mooncake answered error code %d, counted as %s", code,
                           FailureReason.STORE_ERROR)
        return FailureReason.STORE_ERROR
    return reason


def master_reachable(settings: MooncakeSettings, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Does the master accept TCP connections? (Instant "no" when nothing listens.)"""
    host, port = settings.master_host_port
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeClient:
    """One set-up Mooncake client, shared by the backends of a process with equal settings."""

    def __init__(self, settings: MooncakeSettings, store: Any) -> None:
        self.settings = settings
        self.store = store
        self.refs = 0
        self._lock = threading.Lock()
        # Buffer address -> (size, registrations): a pool registered by two backends
        # (one re-attached before the other closed) is unregistered by the last.
        self._buffers: dict[int, tuple[int, int]] = {}
        # True while the master is known unreachable: set by the watcher's probe or
        # by a call that failed its RPC; cleared by the watcher's next good probe.
        self._down = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="hicache-mooncake-watch", daemon=True
        )
        self._watcher.start()

    def register(self, address: int, size: int) -> None:
        with self._lock:
            known = self._buffers.get(address)
            if known is not None and known[0] == size:
                self._buffers[address] = (size, known[1] + 1)
                return
            code = int(self.store.register_buffer(address, size))
            if code != 0:
                raise StorageError(
                    f"mooncake storage: registering {size} bytes of memory failed (code {code})"
                )
            self._buffers[address] = (size, 1)

    def unregister(self, address: int) -> None:
        with self._lock:
            known = self._buffers.get(address)
            if known is None:
                return
            size, count = known
            if count > 1:
                self._buffers[address] = (size, count - 1)
                return
            del self._buffers[address]
            code = int(self.store.unregister_buffer(address))
        if code != 0:
            logger.warning("mooncake storage: unregistering a buffer failed (code %d)", code)

    def usable(self) -> bool:
        """False while the master is known unreachable: calls then fail without the library."""
        with self._lock:
            return not self._down

    def saw_codes(self, codes: Sequence[int]) -> None:
        """Note a call's answers: an RPC failure means the master may be gone."""
        if RPC_FAIL in codes or -1010 in codes:
            self._set_down(True)

    def _set_down(self, down: bool) -> None:
        with self._lock:
            changed, self._down = self._down != down, down
        if changed and down:
            logger.warning(
                "mooncake master %s is not answering: L3 calls fail at once until it is back",
                self.settings.master_server_address,
            )
        elif changed:
            logger.warning(
                "mooncake master %s accepts connections again",
                self.settings.master_server_address,
            )

    def _watch(self) -> None:
        """Probe the master every WATCH_INTERVAL_S (a TCP connect: refused at once when down)."""
        while not self._stop.wait(WATCH_INTERVAL_S):
            self._set_down(not master_reachable(self.settings))

    def close(self) -> None:
        self._stop.set()
        self._watcher.join()
        with self._lock:
            addresses = list(self._buffers)
            self._buffers.clear()
        for address in addresses:
            with contextlib.suppress(Exception):
                self.store.unregister_buffer(address)
        with contextlib.suppress(Exception):
            self.store.close()


_clients: dict[MooncakeSettings, MooncakeClient] = {}
_clients_lock = threading.Lock()


def acquire_client(settings: MooncakeSettings) -> MooncakeClient:
    """The process's client for ``settings``, set up on first use (StorageUnavailableError)."""
    with _clients_lock:
        client = _clients.get(settings)
        if client is None:
            client = MooncakeClient(settings, _setup_store(settings))
            _clients[settings] = client
        client.refs += 1
        return client


def release_client(client: MooncakeClient) -> None:
    with _clients_lock:
        client.refs -= 1
        if client.refs > 0:
            return
        if _clients.get(client.settings) is client:
            del _clients[client.settings]
    client.close()


def _setup_store(settings: MooncakeSettings) -> Any:
    address = settings.master_server_address
    # The library retries an unreachable master for over a minute; a TCP connect
    # answers at once, so an unreachable store is reported right away.
    if not master_reachable(settings):
        raise StorageUnavailableError(
            f"mooncake storage: the master at {address} is unreachable (nothing accepts "
            "connections there); start mooncake_master or fix master_server_address"
        )
    store = MooncakeDistributedStore()
    missing = [name for name in _REQUIRED_METHODS if not hasattr(store, name)]
    if missing:
        raise StorageError(
            f"mooncake storage: this mooncake client lacks {', '.join(missing)}; "
            "upgrade mooncake-transfer-engine to 0.3.6 or later"
        )
    code = int(
        store.setup(
            settings.local_hostname, settings.metadata_server, settings.global_segment_size,
            settings.local_buffer_size, settings.protocol, settings.device_name, address,
        )
    )
    if code != 0:
        with contextlib.suppress(Exception):
            store.close()
        raise StorageUnavailableError(
            f"mooncake storage: setting up the client failed (code {code}) with master {address}, "
            f"metadata server {settings.metadata_server}, protocol {settings.protocol}, "
            f"local hostname {settings.local_hostname}; the client's log says why"
        )
    logger.info(
        "mooncake client up: master %s, %s, lending %.2f GB", address, settings.protocol,
        settings.global_segment_size / 1e9,
    )
    return store
