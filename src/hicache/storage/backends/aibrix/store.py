"""One AIBrix KVCache manager (its L1 host cache over a RocksDB L2), shared in a process.

How our pages map onto AIBrix's API. AIBrix stores *blocks*: ``block_ntokens``
tokens of KV, addressed either by the tokens themselves or by *block hashes*
(strings that, as its docs put it, already name the block's position and all
the tokens before it). Our page keys are exactly that (chained, namespaced),
so one of our pages is one AIBrix block: the block size is our page size in
tokens, and a block's hash is ``frame.object_name(key, order)`` (the key in
hex plus the row-order tag), which is also the block's RocksDB key. Every
call passes no prefix and the page names as the query.

AIBrix sizes a block as ``2 * tokens * layers * heads * head_size * dtype``
bytes. We describe the block as raw bytes (uint8, one layer, one head) with a
``head_size`` that makes it hold our framed page (``payload || header``, see
``frame``), rounded up to the next multiple of ``2 * page_size`` bytes: at
most that many bytes of padding per page, after the header. AIBrix never
looks inside a block, so the real KV geometry does not need to be its own.

Sharing. RocksDB lets one handle at a time open a directory, so backends in
one process with the same settings and block geometry share one manager
(reference counted, ``acquire_store``/``release_store``); pages one stores
the others read, from the L1 or RocksDB. Another *process* cannot open the
same directory while this one holds it: its attach fails with
``StorageUnavailableError``. Each block geometry gets its own subdirectory of
``path``, and so does each tensor-parallel rank (``shard``): the ranks are
processes, each with its own KV shard, so each opens its own RocksDB (found
again by a restart with the same rank).

The manager reads its configuration from environment variables while it is
built (``settings``); they are set, under a lock, only for that
moment. Importing AIBrix installs uvloop as asyncio's global event loop
policy; we put the previous policy back at once, so the server's own loop is
not changed by merely loading the backend (AIBrix's private loop, built
after that, is then a standard asyncio loop).

Pinned memory: AIBrix pins its L1 slabs when its device is "cpu", which
fails under a CPU-only torch. Its ``cache_manager.TESTING_DISABLE_PIN_MEMORY``
switch turns that off. We set it always: we only copy between AIBrix's slabs
and our host pool on the CPU, never DMA from them to a GPU, so pinning would
buy nothing (and slow start-up down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import rocksdict  # noqa: F401 - AIBrix imports it only when the L2 opens; fail at load instead
import torch

from hicache.storage.backends.aibrix.settings import FIXED_ENV, AibrixSettings
from hicache.storage.base import MAX_BATCH_PAGES, StorageError, StorageUnavailableError
from hicache.storage.failure_reasons import CountedReason, FailureReason
from hicache.storage.frame import HEADER_BYTES

logger = logging.getLogger(__name__)


def _import_aibrix() -> Any:
    policy = asyncio.get_event_loop_policy()
    # Read once at import (memory_region.MR_USE_COMPACT_LAYOUT): block-hash keys need it off.
    name = "AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED"
    with _environment({name: FIXED_ENV[name]}):
        try:
            import aibrix_kvcache
            from aibrix_kvcache import cache_manager
        finally:
            asyncio.set_event_loop_policy(policy)
    cache_manager.TESTING_DISABLE_PIN_MEMORY = True
    return aibrix_kvcache


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


aibrix = _import_aibrix()
from aibrix_kvcache.spec import (  # noqa: E402 - after the import above restored the loop policy
    KVCacheBlockLayout,
    KVCacheBlockSpec,
    KVCacheTensorSpec,
    ModelSpec,
)

# Environment variables are process-wide: one manager is built at a time.
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class BlockGeometry:
    """An AIBrix block holding one framed page of ``page_tokens`` tokens."""

    page_tokens: int
    page_bytes: int

    @property
    def block_bytes(self) -> int:
        unit = 2 * self.page_tokens  # AIBrix's block bytes are a multiple of 2 * tokens
        return -(-(self.page_bytes + HEADER_BYTES) // unit) * unit

    @property
    def directory(self) -> str:
        """The subdirectory of ``path`` whose RocksDB holds blocks of this geometry."""
        return f"{self.page_tokens}t-{self.block_bytes}b"


@dataclass(frozen=True)
class Outcome:
    """How many leading blocks a call did, and why it stopped short (None: it did not)."""

    count: int
    reason: CountedReason | None = None


# A block's bytes, as a writable uint8 array over AIBrix's memory: [block_bytes].
BlockFiller = Callable[[int, np.ndarray], None]
BlockReader = Callable[[int, np.ndarray], CountedReason | None]


class AibrixStore:
    """A cache manager for one (settings, geometry, shard), rebuilt by ``clear``. Thread-safe.

    ``shard`` names the subdirectory of one tensor-parallel rank ("" without one).
    """

    def __init__(self, settings: AibrixSettings, geometry: BlockGeometry, shard: str = "") -> None:
        self.settings = settings
        self.geometry = geometry
        self.shard = shard
        self.rocksdb_root = settings.path / shard / geometry.directory
        # Calls share the manager; clear() and close() swap it out exclusively.
        self._gate = _SharedGate()
        self._manager: Any = self._build()

    @property
    def manager(self) -> Any:
        """The ``aibrix_kvcache`` cache manager (for the bench baseline and tests)."""
        return self._manager

    def hashes(self, names: Sequence[str]) -> Any:
        return aibrix.BlockHashes(list(names), self.geometry.page_tokens)

    # ------------------------------------------------------------ operations
    def exists(self, names: Sequence[str]) -> Outcome:
        with self._gate.shared():
            manager = self._manager
            if manager is None:
                return Outcome(0, FailureReason.UNAVAILABLE)
            status = self._call("exists", lambda: manager.exists(None, self.hashes(names)))
            if status is None:
                return Outcome(0, FailureReason.IO_ERROR)
            return self._blocks(status)

    def read(self, names: Sequence[str], consume: BlockReader) -> Outcome:
        """Hand each found block to ``consume`` in order; stop at the first it rejects."""
        with self._gate.shared():
            manager = self._manager
            if manager is None:
                return Outcome(0, FailureReason.UNAVAILABLE)
            status = self._call("acquire", lambda: manager.acquire(None, self.hashes(names)))
            if status is None:
                return Outcome(0, FailureReason.IO_ERROR)
            if not status.is_ok():
                return Outcome(0, _reason(status))
            num_tokens, handle = status.get()
            try:
                tensors = handle.to_tensors()[: num_tokens // self.geometry.page_tokens]
                for i, tensor in enumerate(tensors):
                    reason = consume(i, tensor.reshape(-1).numpy())
                    if reason is not None:
                        return Outcome(i, reason)
            finally:
                handle.release()
            short = len(tensors) < len(names)
            return Outcome(len(tensors), FailureReason.MISSING if short else None)

    def write(self, names: Sequence[str], fill: BlockFiller) -> Outcome:
        """Store ``len(names)`` blocks, each filled in place by ``fill(i, block)``."""
        with self._gate.shared():
            manager = self._manager
            if manager is None:
                return Outcome(0, FailureReason.UNAVAILABLE)
            hashes = self.hashes(names)
            status = self._call("allocate_for", lambda: manager.allocate_for(None, hashes))
            if status is None:
                return Outcome(0, FailureReason.IO_ERROR)
            if not status.is_ok():
                return Outcome(0, _reason(status))
            handle = status.get()
            try:
                for i, tensor in enumerate(handle.to_tensors()):
                    fill(i, tensor.reshape(-1).numpy())
            except BaseException:
                handle.release()
                raise
            # put() owns the handle from here: it keeps or releases every block.
            status = self._call("put", lambda: manager.put(None, hashes, handle))
            if status is None:
                return Outcome(0, FailureReason.IO_ERROR)
            return self._blocks(status, expected=len(names))

    def delete(self, names: Sequence[str]) -> None:
        with self._gate.shared():
            manager = self._manager
            if manager is not None:
                self._call("delete", lambda: manager.delete(None, self.hashes(names)))

    def clear(self) -> None:
        """Drop every block: the L1's and this geometry's RocksDB directory."""
        with self._gate.exclusive():
            self._close_manager()
            try:
                shutil.rmtree(self.rocksdb_root, ignore_errors=False)
            except FileNotFoundError:
                pass
            except OSError as error:
                logger.warning("aibrix: could not remove %s: %s", self.rocksdb_root, error)
            try:
                self._manager = self._build()
            except StorageError as error:  # left unusable: every call answers "unavailable"
                logger.warning("aibrix: reopening after clear failed: %s", error)

    def close(self) -> None:
        with self._gate.exclusive():
            self._close_manager()

    # ------------------------------------------------------------ internals
    def _blocks(self, status: Any, expected: int | None = None) -> Outcome:
        """Tokens in an AIBrix status as blocks (NOT_FOUND: none, and no failure)."""
        if status.is_ok():
            count = int(status.get()) // self.geometry.page_tokens
            short = expected is not None and count < expected
            return Outcome(count, FailureReason.IO_ERROR if short else None)
        if status.error_code is aibrix.StatusCodes.NOT_FOUND:
            return Outcome(0)
        return Outcome(0, _reason(status))

    @staticmethod
    def _call(what: str, fn: Callable[[], Any]) -> Any:
        """One manager call; None when it raised (AIBrix asserts and raises on I/O errors)."""
        try:
            return fn()
        except Exception as error:  # any error of the library is a failed call, never ours
            logger.warning("aibrix %s failed: %s: %s", what, type(error).__name__, error)
            return None

    def _close_manager(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception as error:  # closing must not fail our close()
                logger.warning("aibrix: closing the cache manager failed: %s", error)

    def _build(self) -> Any:
        settings, geometry = self.settings, self.geometry
        if settings.l2:
            try:
                self.rocksdb_root.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise StorageUnavailableError(
                    f"aibrix storage: cannot use directory {self.rocksdb_root}: {error}"
                ) from error
        # Room for one batch in flight each way on top of the L1 (AIBrix adds it to its pool).
        batch_tokens = MAX_BATCH_PAGES * geometry.page_tokens
        unit = 2 * geometry.page_tokens
        spec_args = {
            "block_ntokens": geometry.page_tokens,
            "block_dtype": torch.uint8,
            "block_layout": KVCacheBlockLayout.NCLD,
            "tensor_spec": KVCacheTensorSpec(
                heads=[0], layers=[0], head_size=geometry.block_bytes // unit
            ),
        }
        with _BUILD_LOCK, _environment(settings.environment(self.rocksdb_root)):
            try:
                config = aibrix.KVCacheConfig(
                    block_spec=KVCacheBlockSpec(**spec_args),
                    model_spec=ModelSpec(
                        max_model_len=batch_tokens, max_num_batched_tokens=batch_tokens
                    ),
                    multi_threaded=True,
                )
                manager = aibrix.BaseKVCacheManager(config)
            except Exception as error:  # RocksDB locked by another process, a bad path ...
                raise StorageUnavailableError(
                    f"aibrix storage: cannot open the AIBrix cache at {self.rocksdb_root}: "
                    f"{type(error).__name__}: {error}"
                ) from error
        assert manager.block_spec.block_nbytes == geometry.block_bytes
        return manager


# AIBrix status codes by name (its StatusCodes, as of aibrix-kvcache 0.8) -> our reasons; a code
# this table does not know is a "store_error".
_REASONS = {
    "NOT_FOUND": FailureReason.MISSING, "ERROR": FailureReason.IO_ERROR,
    "TIMEOUT": FailureReason.TIMEOUT, "OUT_OF_MEMORY": FailureReason.OUT_OF_MEMORY,
    "DENIED": FailureReason.DENIED, "CANCELLED": FailureReason.CANCELLED,
    "INVALID": FailureReason.INVALID,
}


def _reason(status: Any) -> FailureReason:
    """A failure reason for our stats from an AIBrix status code."""
    name = str(status.error_code.name)
    reason = _REASONS.get(name)
    if reason is None:
        logger.debug("aibrix: status code %s counted as %s", name, FailureReason.STORE_ERROR)
        return FailureReason.STORE_ERROR
    return reason


class _SharedGate:
    """Many holders of ``shared`` at once, or one of ``exclusive`` (which waits for them).

    A waiting ``exclusive`` holds back new ``shared`` holders, so a steady stream
    of calls cannot starve ``clear``/``close``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


# ------------------------------------------------------------ sharing in a process
_StoreKey = tuple[AibrixSettings, BlockGeometry, str]
_OPEN: dict[_StoreKey, tuple[AibrixStore, int]] = {}
_OPEN_LOCK = threading.Lock()


def acquire_store(
    settings: AibrixSettings, geometry: BlockGeometry, shard: str = ""
) -> AibrixStore:
    """The process's store for ``settings``, ``geometry`` and ``shard``, opened on first use."""
    key = (settings, geometry, shard)
    with _OPEN_LOCK:
        found = _OPEN.get(key)
        if found is not None:
            store, users = found
            _OPEN[key] = (store, users + 1)
            return store
        for other_settings, other_geometry, other_shard in _OPEN:
            same_directory = other_settings.path == settings.path and other_shard == shard
            if same_directory and other_geometry == geometry:
                raise StorageError(
                    f"aibrix storage: {settings.path} is already open in this process with "
                    "other settings; backends sharing a path must use the same options"
                )
        store = AibrixStore(settings, geometry, shard)
        _OPEN[key] = (store, 1)
        return store


def release_store(store: AibrixStore) -> None:
    """Drop one user of ``store``; the last one closes it."""
    key = (store.settings, store.geometry, store.shard)
    with _OPEN_LOCK:
        found = _OPEN.get(key)
        if found is None or found[0] is not store:
            return
        _, users = found
        if users > 1:
            _OPEN[key] = (store, users - 1)
            return
        del _OPEN[key]
        # Closed under the lock: a new store on the same directory waits for RocksDB's lock.
        store.close()
