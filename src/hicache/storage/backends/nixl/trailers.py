"""Registered memory for page trailers: where headers wait to be written, or land when read.

The header of a page cannot live in the host pool, which holds payloads only,
but NIXL moves bytes between registered memory and files only. So each call
borrows a buffer of ``MAX_BATCH_PAGES`` trailer slots, registered with the
agent once when it is made and reused by later calls; concurrent calls each
get their own (a new one is made when none is free).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import numpy as np

from hicache.storage.backends.nixl.agent import NixlAgent
from hicache.storage.base import MAX_BATCH_PAGES


class TrailerSlots:
    """One registered buffer of trailer slots; page aligned (O_DIRECT needs it)."""

    def __init__(self, agent: NixlAgent, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._memory = mmap.mmap(-1, MAX_BATCH_PAGES * slot_bytes)
        self._view = memoryview(self._memory)
        self.base_address = int(np.frombuffer(self._memory, dtype=np.uint8).ctypes.data)
        agent.register_dram(self.base_address, len(self._memory))

    def address(self, slot: int) -> int:
        return self.base_address + slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]


class TrailerPool:
    """``TrailerSlots`` buffers, one per concurrent call, made on demand and reused.

    Registrations stay until the agent is closed (it deregisters them); the
    buffers' memory must outlive them, so ``close`` is left to the agent's
    owner, after the agent's.
    """

    def __init__(self, agent: NixlAgent, slot_bytes: int) -> None:
        self._agent = agent
        self._slot_bytes = slot_bytes
        self._free: list[TrailerSlots] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[TrailerSlots]:
        with self._lock:
            slots = self._free.pop() if self._free else None
        if slots is None:
            slots = TrailerSlots(self._agent, self._slot_bytes)
        try:
            yield slots
        finally:
            with self._lock:
                self._free.append(slots)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
