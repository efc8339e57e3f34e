"""The Mooncake TransferEngine over a device pool's buffer.

Peers find each other without a metadata service (Mooncake's P2P handshake mode):
a session is ``host:rpc_port`` of the peer's engine, which it tells the other side
through the bootstrap handshake. Each side registers its pool's whole flat buffer,
so any page of it is a valid source or destination.
"""

from __future__ import annotations

import logging
import threading

from hicache.memory.device_pool import DevicePool

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"


class KVTransferError(RuntimeError):
    """A batch of KV chunks could not be written to the peer (gone, refused, I/O error)."""


class TransferEngineUnavailableError(OSError):
    """The Mooncake transfer engine cannot be imported or started here."""


class KVTransferEngine:
    """One TransferEngine per instance, its pool's buffer registered.

    ``write`` is blocking and thread-safe (the library serializes what it must);
    callers run it on their own threads, never the scheduler's.
    """

    def __init__(self, pool: DevicePool, host: str, protocol: str = "tcp") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise TransferEngineUnavailableError(
                "the Mooncake transfer engine is not installed: pip install 'hicache[mooncake]' "
                f"({error})"
            ) from error
        self._engine = TransferEngine()
        code = self._engine.initialize(host, P2P_HANDSHAKE, protocol, "")
        if code != 0:
            raise TransferEngineUnavailableError(
                f"the Mooncake transfer engine did not start on {host} ({protocol}): code {code}"
            )
        self.host = host
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._buffer = pool.flat
        code = self._engine.register_memory(pool.flat.data_ptr(), pool.size_bytes)
        if code != 0:
            raise TransferEngineUnavailableError(
                f"registering the KV pool ({pool.size_bytes} bytes) failed: code {code}"
            )
        self._lock = threading.Lock()
        self._closed = False
        logger.info("KV transfer engine at %s (%s)", self.session_id, protocol)

    def write(
        self, peer_session: str, sources: list[int], destinations: list[int],
        lengths: list[int],
    ) -> None:
        """Copy each local ``sources[i]`` to the peer's ``destinations[i]`` (``lengths[i]``
        bytes) in one batch; raises KVTransferError when any chunk fails."""
        if not sources:
            return
        code = self._engine.batch_transfer_sync_write(peer_session, sources, destinations,
                                                      lengths)
        if code != 0:
            raise KVTransferError(
                f"writing {len(sources)} KV chunks ({sum(lengths)} bytes) to {peer_session} "
                f"failed (code {code}): the peer is gone or refused them"
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.unregister_memory(self._buffer.data_ptr())
