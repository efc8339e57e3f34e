"""An in-memory L3 backend for cache-level tests, with faults on demand.

Several instances may share one ``MemoryStore`` (two "servers" on one L3).
It keeps each page as a clone of the host page's canonical view, so it works
with every host layout, and verifies nothing: corruption injected here is
what a backend without checksums would return (used to test that the cache
itself never mixes up pages), while ``drop`` makes objects vanish and ``stall``
makes calls hang (a hung NFS mount, a stalled remote store) until released.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError
from hicache.storage.failure_reasons import FailureReason


class MemoryStore:
    def __init__(self) -> None:
        self.pages: dict[bytes, torch.Tensor] = {}
        self.lock = threading.Lock()


class MemoryBackend(StorageBackend):
    name = "memory"

    def __init__(
        self, store: MemoryStore | None = None, extra_config: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(extra_config)
        self.store = store or MemoryStore()
        self.down = False  # every call fails as "unreachable"
        self.unreachable_at_attach = False
        self.raise_errors = False  # calls raise instead of reporting
        self.delay_per_batch = 0.0  # seconds each get/set call takes
        self.delay_per_page = 0.0  # seconds each get takes more per page it reads
        self.calls: list[str] = []
        # Keys that exist but fail verification when read (a corrupted object).
        self.corrupt_keys: set[bytes] = set()
        self.closed = 0
        # Operation -> gate: its calls block until the gate is set (see ``stall``).
        self.gates: dict[str, threading.Event] = {}
        # (operation, host pages) of every call that blocked on a gate.
        self.stalled: list[tuple[str, PageIds]] = []

    def attach(self, host: HostPool) -> None:
        if self.unreachable_at_attach:
            raise StorageUnavailableError("memory store is down")
        super().attach(host)

    def close(self) -> None:
        self.closed += 1

    def _fault(self, what: str, pages: int) -> bool:
        self._check_open()
        self.calls.append(what)
        if self.raise_errors:
            raise ConnectionError(f"{what}: injected")
        if self.down:
            with self._lock:
                self._stats.fail(FailureReason.UNREACHABLE, pages)
            return True
        return False

    def exists(self, keys: Sequence[bytes]) -> int:
        self._check_args(keys)
        if self._fault("exists", len(keys)):
            return 0
        with self._lock:
            self._stats.exists_queries += 1
        with self.store.lock:
            for i, key in enumerate(keys):
                if key not in self.store.pages:
                    return i
        return len(keys)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self._check_args(keys, host_pages)
        if self._fault("get", len(keys)):
            return 0
        if self._hold("get", host_pages):
            # A read that returns this late lands garbage: had its pages been handed
            # to anyone meanwhile, their KV would now be wrong.
            for page in np.asarray(host_pages).tolist():
                self.host.pages[page].fill_(float("nan"))
            return 0
        # A slow store, on purpose.
        time.sleep(self.delay_per_batch + self.delay_per_page * len(keys))
        for i, (key, page) in enumerate(zip(keys, host_pages, strict=True)):
            with self.store.lock:
                value = self.store.pages.get(key)
            if value is None or key in self.corrupt_keys:
                with self._lock:
                    self._stats.fail(
                        FailureReason.MISSING if value is None else FailureReason.CORRUPT)
                return i
            self.host.pages[int(page)] = value
            with self._lock:
                self._stats.pages_read += 1
                self._stats.bytes_read += self.page_bytes
        return len(keys)

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        self._check_args(keys, host_pages)
        if self._fault("set", len(keys)):
            return 0
        self._hold("set", host_pages)  # then stores what its host pages hold by now
        time.sleep(self.delay_per_batch)  # a slow store, on purpose
        for key, page in zip(keys, host_pages, strict=True):
            with self.store.lock:
                if key in self.store.pages:
                    self._stats.pages_skipped_existing += 1
                    continue
                self.store.pages[key] = self.host.pages[int(page)].clone()
            with self._lock:
                self._stats.pages_written += 1
                self._stats.bytes_written += self.page_bytes
        return len(keys)

    def clear(self) -> None:
        self._check_open()
        with self.store.lock:
            self.store.pages.clear()

    def _drop(self, keys: Sequence[bytes]) -> None:
        with self.store.lock:
            for key in keys:
                self.store.pages.pop(key, None)

    def _check_open(self, keys: Sequence[bytes] = (), host_pages: PageIds | None = None) -> None:
        if self.closed:
            raise StorageError("memory backend used after close()")
        self._check_args(keys, host_pages)

    # ----------------------------------------------------------- test hooks
    def stall(self, what: str) -> threading.Event:
        """From now on calls of ``what`` ("get" or "set") hang until the event is set."""
        gate = threading.Event()
        self.gates[what] = gate
        return gate

    def stalled_pages(self, what: str) -> list[PageIds]:
        """Host pages handed to each call of ``what`` that hung."""
        with self._lock:
            return [pages for op, pages in self.stalled if op == what]

    def _hold(self, what: str, host_pages: PageIds) -> bool:
        gate = self.gates.get(what)
        if gate is None or gate.is_set():
            return False
        with self._lock:
            self.stalled.append((what, np.asarray(host_pages).copy()))
        gate.wait()
        return True

    def drop(self, key: bytes) -> None:
        with self.store.lock:
            del self.store.pages[key]
