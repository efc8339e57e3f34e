"""The put skeleton (``base.LookupPutBackend.set``) on a toy store: what it asks the
backend's steps, what it counts and what it answers, apart from any transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.base import LookupPutBackend, PutBatch, StorageError
from hicache.storage.failure_reasons import FailureReason


@dataclass
class _ToyPut(PutBatch):
    names: list[bytes]


class ToyBackend(LookupPutBackend[_ToyPut]):
    """Pages in a dict; ``refused`` keys fail their put, ``down`` fails the lookup."""

    name = "toy"

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[bytes, int] = {}
        self.refused: set[bytes] = set()
        self.taken_meanwhile: set[bytes] = set()  # stored by another writer after the lookup
        self.down = False
        self.lookups = 0
        self.puts: list[list[bytes]] = []

    def exists(self, keys: Sequence[bytes]) -> int:
        raise NotImplementedError

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        raise NotImplementedError

    def clear(self) -> None:
        self.objects.clear()

    def _begin_put(self, keys: Sequence[bytes], host_pages: PageIds) -> _ToyPut:
        self._check_open(keys, host_pages)
        return _ToyPut(keys, np.asarray(host_pages).tolist(), self.page_bytes, list(keys))

    def _lookup(self, batch: _ToyPut) -> list[bool] | None:
        self.lookups += 1
        if self.down:
            self._fail(FailureReason.UNREACHABLE, len(batch.names))
            return None
        return [name in self.objects for name in batch.names]

    def _put(self, batch: _ToyPut, todo: list[int], stored: list[bool]) -> int:
        self.puts.append([batch.names[i] for i in todo])
        written = 0
        for i in todo:
            name = batch.names[i]
            if name in self.refused:
                self._fail(FailureReason.NO_SPACE)
                break
            stored[i] = True
            if name in self.taken_meanwhile:
                continue
            self.objects[name] = batch.pages[i]
            written += 1
        return written


def _key(n: int) -> bytes:
    return n.to_bytes(16, "little")


@pytest.fixture
def backend() -> ToyBackend:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    toy = ToyBackend()
    toy.attach(HostPool(geometry, 8, 4, MemLayout.PAGE_FIRST, pin_memory=False))
    return toy


def test_only_the_missing_pages_are_put(backend: ToyBackend) -> None:
    keys = [_key(n) for n in range(4)]
    backend.objects[keys[1]] = 0
    backend.taken_meanwhile.add(keys[3])
    assert backend.set(keys, np.arange(4)) == 4
    assert backend.puts == [[keys[0], keys[2], keys[3]]]
    stats = backend.stats()
    assert (stats.pages_written, stats.pages_skipped_existing) == (2, 1)
    assert stats.bytes_written == 2 * backend.page_bytes and stats.write_seconds > 0
    assert backend.set(keys[:2], np.arange(2)) == 2 and len(backend.puts) == 1  # all stored


def test_the_answer_ends_at_the_first_page_not_stored(backend: ToyBackend) -> None:
    keys = [_key(n) for n in range(4)]
    backend.objects[keys[3]] = 0
    backend.refused.add(keys[1])
    assert backend.set(keys, np.arange(4)) == 1
    stats = backend.stats()
    assert (stats.pages_written, stats.pages_skipped_existing) == (1, 1)
    assert stats.failures == {"no_space": 1}


def test_a_failed_lookup_stores_nothing_and_counts_no_write(backend: ToyBackend) -> None:
    backend.down = True
    assert backend.set([_key(1), _key(2)], np.arange(2)) == 0
    stats = backend.stats()
    assert backend.puts == [] and stats.failures == {"unreachable": 2}
    assert (stats.pages_written, stats.write_seconds) == (0, 0.0)


def test_an_empty_batch_asks_nothing(backend: ToyBackend) -> None:
    assert backend.set([], np.arange(0)) == 0
    assert backend.lookups == 0 and backend.stats().write_seconds == 0.0


def test_misuse_raises_before_the_store_is_asked(backend: ToyBackend) -> None:
    with pytest.raises(StorageError, match="host pages"):
        backend.set([_key(1)], np.arange(2))
    assert backend.lookups == 0
