"""The L3 backend contract as a reusable test suite (``hicache.storage.base``).

Every backend's test module subclasses ``StorageContract`` and says how to
build the backend::

    class TestFileContract(StorageContract):
        def make_backend(self, store: Any) -> StorageBackend:
            return FileBackend({"path": str(store)})

``make_backend`` returns a new, *unattached* backend over ``store``; the suite
attaches it to a real ``HostPool`` and closes it afterwards. Several backends
made over the same ``store`` within one test must share their pages, like
two servers on one L3 (the suite checks that they do). ``store`` is a fixture:
by default a fresh directory per test; override it to hand ``make_backend``
whatever names a shared store (a running server's address, an in-memory
store object, ...).

Page keys are real chained keys (``radix.keys``) under a namespace unique to
each test, so a store that outlives one test (a server shared by a whole
session) does not leak pages into the next one, except through ``clear``.

The pool geometry is small (bf16, so pages are not a multiple of 4-byte
elements) and can be overridden through the class attributes; ``MLA_GEOMETRY``
is the one-latent-per-layer geometry every backend is also run with.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.allocator import PageIds
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.memory.page_digests import DigestState
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.base import MAX_BATCH_PAGES, StorageBackend, StorageError
from hicache.storage.frame import checksum
from hicache.storage.page_regions import PageRegions

OpenBackend = Callable[..., tuple[StorageBackend, HostPool]]


def page_ids(*ids: int) -> PageIds:
    return np.asarray(ids, dtype=np.int64)


def page_range(start: int, stop: int) -> PageIds:
    return np.arange(start, stop, dtype=np.int64)


def fill_random(host: HostPool, pages: PageIds, seed: int) -> torch.Tensor:
    """Write random KV into ``pages``; returns it (canonical view order) for comparison."""
    geometry = host.geometry
    shape = (
        len(pages), geometry.num_layers, geometry.kv_planes, host.page_size, geometry.row_elems
    )
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator).to(geometry.dtype)
    host.pages[torch.from_numpy(pages)] = values
    return values


def page_bytes_of(host: HostPool, pages: PageIds) -> bytes:
    """The exact bytes of ``pages`` in canonical order (bit-for-bit comparison, NaN-safe)."""
    return host.pages[torch.from_numpy(pages)].contiguous().view(torch.uint8).numpy().tobytes()


def as_bytes(values: torch.Tensor) -> bytes:
    return values.contiguous().view(torch.uint8).numpy().tobytes()


# An MLA geometry: one latent plane per layer, a row of 24 bf16 elements (48 bytes).
MLA_GEOMETRY = KVGeometry.mla(num_layers=2, latent_dim=24, dtype=torch.bfloat16)


class StorageContract:
    """The backend contract; subclass it and implement ``make_backend`` (module docstring)."""

    geometry: ClassVar[KVGeometry] = KVGeometry(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    page_size: ClassVar[int] = 4
    # Room for two full batches (source and destination) plus a few spare pages.
    host_num_pages: ClassVar[int] = 2 * MAX_BATCH_PAGES + 16
    # Whether the backend stores pages in checksummed frames (storage.frame); the
    # test doubles keep them bare.
    frames_pages: ClassVar[bool] = True

    def make_backend(self, store: Any) -> StorageBackend:
        """A new, unattached backend over ``store``; backends over one store share pages."""
        raise NotImplementedError

    # ------------------------------------------------------------ fixtures
    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        return tmp_path / "l3"

    @pytest.fixture
    def open_backend(self, store: Any) -> Iterator[OpenBackend]:
        """``open_backend(layout)``: an attached backend over ``store`` and its own host pool."""
        opened: list[StorageBackend] = []

        def open_(layout: MemLayout = MemLayout.PAGE_FIRST) -> tuple[StorageBackend, HostPool]:
            host = self.make_host(layout)
            backend = self.make_backend(store)
            backend.attach(host)
            opened.append(backend)
            return backend, host

        yield open_
        for backend in opened:
            backend.close()

    @pytest.fixture
    def namespace(self) -> KeyNamespace:
        model = f"contract-{uuid.uuid4().hex}"
        return KeyNamespace(model, self.geometry.describe(), self.page_size)

    def make_host(self, layout: MemLayout) -> HostPool:
        return HostPool(
            self.geometry, self.host_num_pages, self.page_size, layout, pin_memory=False
        )

    def keys(
        self, namespace: KeyNamespace, count: int, seed: int = 0, salt: str | None = None
    ) -> list[bytes]:
        """Chained page keys of ``count`` pages of a token sequence chosen by ``seed``."""
        tokens = np.random.default_rng(seed).integers(0, 32000, count * self.page_size)
        return chain_page_keys(pack_tokens(tokens), self.page_size, namespace.seed(salt))

    # --------------------------------------------------------------- tests
    def test_pages_round_trip_bit_exact_in_every_layout(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        for seed, layout in enumerate(MemLayout):
            backend, host = open_backend(layout)
            keys = self.keys(namespace, 6, seed=seed)
            # Scattered, unordered host pages: a backend must honour the mapping.
            source = page_ids(9, 2, 30, 31, 0, 17)
            values = fill_random(host, source, seed=seed)
            assert backend.exists(keys) == 0
            assert backend.set(keys, source) == 6
            assert backend.exists(keys) == 6
            target = page_ids(40, 5, 41, 60, 3, 100)
            fill_random(host, target, seed=1000 + seed)  # something else is there before
            assert backend.get(keys, target) == 6
            assert page_bytes_of(host, target) == as_bytes(values), layout
            assert page_bytes_of(host, source) == as_bytes(values), "set() changed its source"

    def test_a_page_read_into_another_layout_is_right_or_a_miss(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        for seed, written_from in enumerate(MemLayout):
            writer, writer_host = open_backend(written_from)
            keys = self.keys(namespace, 3, seed=seed)
            values = fill_random(writer_host, page_range(0, 3), seed=seed)
            assert writer.set(keys, page_range(0, 3)) == 3
            for read_into in MemLayout:
                reader, reader_host = open_backend(read_into)
                fill_random(reader_host, page_range(10, 13), seed=99)
                got = reader.get(keys, page_range(10, 13))
                assert got in (0, 3), (written_from, read_into, got)
                if got:  # shared across layouts: then the rows must be in the right places
                    assert page_bytes_of(reader_host, page_range(10, 13)) == as_bytes(values)

    def test_exists_counts_the_leading_stored_keys(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 8)
        fill_random(host, page_range(0, 8), seed=1)
        assert backend.exists(keys) == 0
        assert backend.set(keys[:5], page_range(0, 5)) == 5
        assert backend.exists(keys) == 5
        assert backend.exists(keys[:3]) == 3
        assert backend.exists(keys[5:]) == 0
        # A gap: page 6 stored but not page 5; the usable prefix still ends at 5.
        assert backend.set(keys[6:7], page_range(6, 7)) == 1
        assert backend.exists(keys) == 5
        assert backend.exists(keys[6:]) == 1

    def test_get_stops_at_the_first_missing_page(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 6)
        values = fill_random(host, page_range(0, 6), seed=2)
        assert backend.set(keys[:3], page_range(0, 3)) == 3
        assert backend.set(keys[4:], page_range(4, 6)) == 2
        before = sum(backend.stats().failures.values())
        assert backend.get(keys, page_range(20, 26)) == 3
        assert page_bytes_of(host, page_range(20, 23)) == as_bytes(values[:3])
        assert sum(backend.stats().failures.values()) > before, "the miss was not counted"

    def test_get_of_missing_keys_reads_nothing_and_counts_a_miss(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, _ = open_backend()
        keys = self.keys(namespace, 4)
        assert backend.get(keys, page_range(0, 4)) == 0
        stats = backend.stats()
        assert stats.pages_read == 0
        assert sum(stats.failures.values()) >= 1

    def test_set_skips_pages_already_stored_without_rewriting_them(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 4)
        original = fill_random(host, page_range(0, 4), seed=3)
        assert backend.set(keys[1:3], page_range(1, 3)) == 2
        # Same keys, different bytes in the host pages: stored pages stay as they were.
        fill_random(host, page_range(0, 4), seed=4)
        assert backend.set(keys, page_range(0, 4)) == 4
        stats = backend.stats()
        assert stats.pages_written == 4  # 2, then the 2 that were missing
        assert stats.pages_skipped_existing == 2
        assert backend.get(keys[1:3], page_range(10, 12)) == 2
        assert page_bytes_of(host, page_range(10, 12)) == as_bytes(original[1:3])

    def test_a_full_batch_works_and_a_longer_one_is_refused(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, MAX_BATCH_PAGES + 1)
        source = page_range(0, MAX_BATCH_PAGES)
        values = fill_random(host, source, seed=5)
        assert backend.set(keys[:MAX_BATCH_PAGES], source) == MAX_BATCH_PAGES
        assert backend.exists(keys[:MAX_BATCH_PAGES]) == MAX_BATCH_PAGES
        target = page_range(MAX_BATCH_PAGES, 2 * MAX_BATCH_PAGES)
        assert backend.get(keys[:MAX_BATCH_PAGES], target) == MAX_BATCH_PAGES
        assert page_bytes_of(host, target) == as_bytes(values)
        # Callers split longer chains (base.MAX_BATCH_PAGES); a backend refuses them.
        too_many = page_range(0, MAX_BATCH_PAGES + 1)
        with pytest.raises(StorageError, match="at most"):
            backend.exists(keys)
        with pytest.raises(StorageError, match="at most"):
            backend.get(keys, too_many)
        with pytest.raises(StorageError, match="at most"):
            backend.set(keys, too_many)

    def test_empty_batches_are_answered(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, _ = open_backend()
        assert backend.exists([]) == 0
        assert backend.get([], page_ids()) == 0
        assert backend.set([], page_ids()) == 0

    def test_malformed_calls_are_refused(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 2)
        with pytest.raises(StorageError, match="bytes"):
            backend.exists([keys[0], b"short"])
        with pytest.raises(StorageError, match="host pages"):
            backend.set(keys, page_range(0, 1))
        with pytest.raises(StorageError, match="host pages"):
            backend.get(keys, page_ids(0, host.num_pages))
        with pytest.raises(StorageError, match="host pages"):
            backend.set(keys, page_ids(-1, 0))
        assert backend.exists(keys) == 0  # nothing was stored by the refused calls

    def test_use_before_attach_is_an_error(self, store: Any, namespace: KeyNamespace) -> None:
        backend = self.make_backend(store)
        try:
            with pytest.raises(StorageError, match="attach"):
                backend.get(self.keys(namespace, 1), page_ids(0))
        finally:
            backend.close()

    def test_close_is_idempotent_and_use_after_close_is_an_error(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 2)
        fill_random(host, page_range(0, 2), seed=6)
        assert backend.set(keys, page_range(0, 2)) == 2
        backend.close()
        backend.close()
        calls: list[Callable[[], object]] = [
            lambda: backend.exists(keys),
            lambda: backend.get(keys, page_range(2, 4)),
            lambda: backend.set(keys, page_range(0, 2)),
            backend.clear,
        ]
        for call in calls:
            with pytest.raises(StorageError, match="close"):
                call()
        # The store itself is untouched: a new backend still finds the pages.
        other, _ = open_backend()
        assert other.exists(keys) == 2

    def test_clear_removes_every_page(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 5)
        values = fill_random(host, page_range(0, 5), seed=7)
        assert backend.set(keys, page_range(0, 5)) == 5
        backend.clear()
        assert backend.exists(keys) == 0
        assert backend.get(keys, page_range(10, 15)) == 0
        other, _ = open_backend()
        assert other.exists(keys) == 0, "another instance still sees cleared pages"
        # The store is usable again: the pages are written anew, not skipped.
        assert backend.set(keys, page_range(0, 5)) == 5
        assert backend.get(keys, page_range(10, 15)) == 5
        assert page_bytes_of(host, page_range(10, 15)) == as_bytes(values)

    def test_discard_drops_pages_so_that_set_stores_them_anew(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 4)
        fill_random(host, page_range(0, 4), seed=11)
        assert backend.set(keys, page_range(0, 4)) == 4
        before = backend.stats()
        # Page 1 was found damaged after a read (the cache's load): it must go.
        assert backend.discard(keys[1:2]) == 1
        assert backend.discard([]) == 0
        assert backend.exists(keys) == 1
        assert backend.get(keys[1:2], page_range(10, 11)) == 0
        other, _ = open_backend()
        assert other.get(keys[1:2], page_range(20, 21)) == 0, "another instance read it"
        after = backend.stats()
        assert after.failures.get("corrupt", 0) == before.failures.get("corrupt", 0) + 1
        # The recomputed page is stored in its place; the others are skipped.
        fresh = fill_random(host, page_range(0, 4), seed=12)
        assert backend.set(keys, page_range(0, 4)) == 4
        assert backend.stats().pages_written == after.pages_written + 1
        assert backend.get(keys[1:2], page_range(10, 11)) == 1
        assert page_bytes_of(host, page_range(10, 11)) == as_bytes(fresh[1:2])

    def test_puts_take_the_caches_checksum_and_reads_can_leave_the_check_to_it(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        """A page the cache checksummed while copying it in is not hashed again for its
        frame, and with ``defer_checks`` a read records the frame's checksum for the
        cache's load to verify instead of hashing the page (memory.page_digests)."""
        if not self.frames_pages:
            pytest.skip("a test double without frames: nothing is checksummed")
        backend, host = open_backend()
        keys = self.keys(namespace, 3)
        fill_random(host, page_range(0, 3), seed=13)
        wrong = bytes(range(16))
        host.digests.set_known(1, wrong)  # what the put must use, right or not
        assert backend.set(keys, page_range(0, 3)) == 3
        host.digests.defer_checks = True
        assert backend.get(keys, page_range(10, 13)) == 3
        assert [host.digests.state(p) for p in (10, 11, 12)] == [DigestState.EXPECTED] * 3
        assert host.digests.digest(11) == wrong
        right = checksum(PageRegions(host).views(0))
        assert host.digests.digest(10) == right
        # Verified here instead: the page whose frame carries the wrong checksum fails.
        host.digests.defer_checks = False
        assert backend.get(keys, page_range(10, 13)) == 1
        assert host.digests.state(10) is DigestState.KNOWN
        assert backend.stats().failures.get("corrupt", 0) >= 1

    def test_stats_count_what_happened(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        keys = self.keys(namespace, 6)
        fill_random(host, page_range(0, 6), seed=8)
        assert backend.exists(keys) == 0
        assert backend.set(keys[:4], page_range(0, 4)) == 4
        assert backend.set(keys[2:4], page_range(2, 4)) == 2
        assert backend.exists(keys) == 4
        assert backend.get(keys[:4], page_range(10, 14)) == 4
        assert backend.get(keys[:6], page_range(10, 16)) == 4
        stats = backend.stats()
        assert stats.exists_queries == 2
        assert stats.pages_written == 4
        assert stats.pages_skipped_existing == 2
        assert stats.pages_read == 8
        assert stats.bytes_written == 4 * host.page_bytes
        assert stats.bytes_read == 8 * host.page_bytes
        assert stats.read_seconds >= 0 and stats.write_seconds >= 0
        assert sum(stats.failures.values()) >= 1  # the second get stopped at a missing page
        # stats() is a snapshot, not a live view.
        stats.failures["mine"] = 1
        assert "mine" not in backend.stats().failures

    def test_keys_of_different_namespaces_never_collide(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        backend, host = open_backend()
        # The same tokens under another model, another page size, a cache salt.
        others = [
            KeyNamespace(namespace.model + "-other", namespace.kv_layout, namespace.page_size),
            KeyNamespace(namespace.model, namespace.kv_layout + "-other", namespace.page_size),
        ]
        chains = [self.keys(namespace, 3)]
        chains += [self.keys(other, 3) for other in others]
        chains.append(self.keys(namespace, 3, salt="tenant-a"))
        chains.append(self.keys(namespace, 3, salt=""))
        assert len({key for chain in chains for key in chain}) == 3 * len(chains)
        values = []
        for i, chain in enumerate(chains):
            pages = page_range(3 * i, 3 * i + 3)
            values.append(fill_random(host, pages, seed=20 + i))
            for earlier in chains[:i]:
                assert backend.exists(earlier) == 3
            assert backend.exists(chain) == 0, f"chain {i} found before it was stored"
            assert backend.set(chain, pages) == 3
        for i, chain in enumerate(chains):
            target = page_range(100 + 3 * i, 103 + 3 * i)
            assert backend.get(chain, target) == 3
            assert page_bytes_of(host, target) == as_bytes(values[i]), f"chain {i}"

    def test_backends_over_one_store_share_pages(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        first, first_host = open_backend()
        second, second_host = open_backend()
        keys = self.keys(namespace, 4)
        values = fill_random(first_host, page_range(0, 4), seed=9)
        assert first.set(keys, page_range(0, 4)) == 4
        assert second.exists(keys) == 4
        assert second.get(keys, page_range(50, 54)) == 4
        assert page_bytes_of(second_host, page_range(50, 54)) == as_bytes(values)
        # The second finds them stored and does not write them again.
        assert second.set(keys, page_range(50, 54)) == 4
        assert second.stats().pages_written == 0

    def test_lookups_and_io_from_two_threads(
        self, open_backend: OpenBackend, namespace: KeyNamespace
    ) -> None:
        """The storage controller's pattern: one thread asks exists, another moves pages."""
        backend, host = open_backend()
        batches = 12
        keys = self.keys(namespace, 4 * batches)
        values = fill_random(host, page_range(0, 4 * batches), seed=10)
        stop = threading.Event()
        errors: list[BaseException] = []
        seen: list[int] = []

        def query() -> None:
            try:
                while not stop.is_set():
                    seen.append(backend.exists(keys[:MAX_BATCH_PAGES]))
                    stop.wait(0.001)  # a lookup stream, not a busy loop starving the io side
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        thread = threading.Thread(target=query, daemon=True)
        thread.start()
        try:
            for b in range(batches):
                pages = page_range(4 * b, 4 * b + 4)
                assert backend.set(keys[4 * b : 4 * b + 4], pages) == 4
            target = page_range(100, 100 + 4 * batches)
            for b in range(batches):
                batch = slice(4 * b, 4 * b + 4)
                assert backend.get(keys[batch], target[batch]) == 4
        finally:
            stop.set()
            thread.join(timeout=10)
        assert not thread.is_alive()
        assert not errors, errors
        assert seen == sorted(seen), "a lookup went backwards while pages were only added"
        assert page_bytes_of(host, target) == as_bytes(values)
