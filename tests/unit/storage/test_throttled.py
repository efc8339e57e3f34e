"""The throttled backend: its delay arithmetic on a fake clock (latency and bandwidth add up,
parallel calls share the bandwidth), what each call is charged, its settings' errors, and a
wait that holds nothing another call needs."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.storage.backends.file.backend import FileBackend
from hicache.storage.backends.throttled.backend import ThrottledBackend
from hicache.storage.backends.throttled.link import Link
from hicache.storage.backends.throttled.settings import ThrottledSettings
from hicache.storage.base import StorageError
from hicache.storage.options import read_settings
from hicache.storage.registry import create_storage_backend
from tests.storage_reference import MemoryBackend
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4


class FakeClock:
    """A clock that moves only when told to; ``sleep`` records the wait and, if
    ``advance``, moves the clock by it (a call alone) or else leaves it (calls in flight
    at the same moment)."""

    def __init__(self, advance: bool = True) -> None:
        self.now = 100.0
        self.advance = advance
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.advance:
            self.now += seconds


def link(clock: FakeClock, latency_s: float, bandwidth: float | None) -> Link:
    return Link(latency_s, bandwidth, clock=clock, sleep=clock.sleep)


# ------------------------------------------------------------------ the link's arithmetic
def test_a_call_alone_waits_its_latency_plus_its_bytes_over_the_bandwidth() -> None:
    clock = FakeClock()
    throttle = link(clock, latency_s=0.005, bandwidth=1e6)
    assert throttle.delay(2000) == pytest.approx(0.005 + 0.002)
    assert throttle.delay(0) == pytest.approx(0.005)  # a lookup: latency only
    assert clock.waits == pytest.approx([0.007, 0.005])


def test_no_bandwidth_limit_leaves_the_latency_alone_and_no_delay_waits_nothing() -> None:
    clock = FakeClock()
    assert link(clock, 0.003, None).delay(10**12) == pytest.approx(0.003)
    assert link(clock, 0.0, None).delay(10**12) == 0.0
    assert clock.waits == pytest.approx([0.003])  # a zero wait does not sleep


def test_parallel_calls_share_the_bandwidth_and_each_pays_its_own_latency() -> None:
    clock = FakeClock(advance=False)  # three calls in flight at the same moment
    throttle = link(clock, latency_s=0.001, bandwidth=1e6)
    waits = [throttle.delay(1000) for _ in range(3)]
    # Two parallel reads of N bytes take 2N / bandwidth: the bytes queue, the latency overlaps.
    assert waits == pytest.approx([0.001 + 0.001, 0.001 + 0.002, 0.001 + 0.003])
    # Once the queued bytes have gone through, a call is alone again.
    clock.now += 1.0
    assert throttle.delay(1000) == pytest.approx(0.002)


def test_a_call_arriving_while_the_link_is_busy_waits_for_the_rest() -> None:
    clock = FakeClock(advance=False)
    throttle = link(clock, latency_s=0.0, bandwidth=1e3)
    assert throttle.delay(1000) == pytest.approx(1.0)  # busy until now + 1 s
    clock.now += 0.25
    assert throttle.delay(500) == pytest.approx(0.75 + 0.5)


def test_a_link_refuses_negative_latency_and_no_bandwidth() -> None:
    with pytest.raises(ValueError, match="latency"):
        Link(-0.001, None)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 0)


# --------------------------------------------------------------- what each call is charged
@pytest.fixture
def host() -> HostPool:
    return HostPool(GEOMETRY, 16, PAGE_SIZE, MemLayout.PAGE_FIRST, pin_memory=False)


def keys(count: int) -> list[bytes]:
    namespace = KeyNamespace("throttled-test", GEOMETRY.describe(), PAGE_SIZE)
    tokens = np.random.default_rng(0).integers(0, 32000, count * PAGE_SIZE)
    return chain_page_keys(pack_tokens(tokens), PAGE_SIZE, namespace.seed(None))


def pages(start: int, stop: int) -> np.ndarray:
    return np.arange(start, stop, dtype=np.int64)


def over_memory(
    host: HostPool, clock: FakeClock, read: tuple[float, float | None],
    write: tuple[float, float | None],
) -> tuple[ThrottledBackend, MemoryBackend]:
    inner = MemoryBackend()
    backend = ThrottledBackend(
        {"backend": "file"}, inner=inner,
        read_link=link(clock, *read), write_link=link(clock, *write),
    )
    backend.attach(host)
    return backend, inner


def test_reads_pay_for_the_pages_read_lookups_for_latency_writes_for_the_pages_handed(
    host: HostPool,
) -> None:
    clock = FakeClock()
    page_bytes = host.page_bytes
    backend, _ = over_memory(
        host, clock, read=(0.002, page_bytes * 1000.0), write=(0.001, page_bytes * 500.0)
    )
    chain = keys(4)
    assert backend.set(chain[:3], pages(0, 3)) == 3
    assert backend.set(chain[:3], pages(0, 3)) == 3  # all skipped, still charged
    assert backend.exists(chain) == 3
    assert backend.get(chain, pages(8, 12)) == 3  # stops at the missing fourth page
    assert backend.get(chain[3:], pages(8, 9)) == 0  # a miss moves nothing
    assert backend.exists([]) == 0 and backend.get([], pages(0, 0)) == 0  # not delayed
    assert clock.waits == pytest.approx([
        0.001 + 3 / 500, 0.001 + 3 / 500, 0.002, 0.002 + 3 / 1000, 0.002,
    ])
    stats = backend.stats()
    assert stats.pages_read == 3 and stats.pages_written == 3
    # The reads' and writes' waits count in their seconds, as the caller saw them.
    assert stats.read_seconds == pytest.approx(0.002 + 3 / 1000 + 0.002, abs=0.01)
    assert stats.read_seconds >= 0.007 - 1e-9
    assert stats.write_seconds >= 2 * (0.001 + 3 / 500) - 1e-9
    # discard and clear are not delayed; the pages are the wrapped store's.
    assert backend.discard(chain[:1]) == 1
    backend.clear()
    assert len(clock.waits) == 5
    assert backend.stats().failures.get("corrupt") == 1


def test_misuse_is_the_wrapped_backends_error_raised_before_any_wait(host: HostPool) -> None:
    clock = FakeClock()
    inner = MemoryBackend()
    backend = ThrottledBackend(
        {"backend": "file"}, inner=inner,
        read_link=link(clock, 1.0, None), write_link=link(clock, 1.0, None),
    )
    with pytest.raises(StorageError, match="attach"):
        backend.get(keys(1), pages(0, 1))
    backend.attach(host)
    with pytest.raises(StorageError, match="host pages"):
        backend.set(keys(2), pages(0, 1))
    backend.close()
    backend.close()
    assert inner.closed >= 1
    with pytest.raises(StorageError, match="close"):
        backend.exists(keys(1))
    assert clock.waits == []


def test_a_waiting_call_holds_nothing_another_call_needs(host: HostPool) -> None:
    """A call stuck in its wait (past its deadline, abandoned) does not block the next."""
    gate = threading.Event()
    waiting: list[float] = []

    def sleep(seconds: float) -> None:
        waiting.append(seconds)
        if len(waiting) == 1:  # the first call hangs in its wait until the test opens it
            gate.wait(timeout=30)

    read = Link(0.5, 1e6, sleep=sleep)
    backend = ThrottledBackend(
        {"backend": "file"}, inner=MemoryBackend(), read_link=read,
        write_link=Link(0.0, None),
    )
    backend.attach(host)
    chain = keys(2)
    assert backend.set(chain, pages(0, 2)) == 2
    stuck = threading.Thread(target=backend.get, args=(chain, pages(4, 6)), daemon=True)
    stuck.start()
    try:
        assert wait_until(lambda: len(waiting) == 1), "the first read never reached its wait"
        assert backend.get(chain, pages(8, 10)) == 2  # not held up by the one waiting
        assert backend.exists(chain) == 2
        assert backend.stats().pages_read == 4
    finally:
        gate.set()
        stuck.join(timeout=10)
    assert not stuck.is_alive()


# ------------------------------------------------------------------------------ settings
def settings(**extra: object) -> ThrottledSettings:
    return read_settings(ThrottledSettings, extra, "throttled storage")


def test_settings_take_sizes_as_the_other_backends_do_and_default_to_no_delay() -> None:
    read = settings(backend="file", read_bandwidth="200MB", write_bandwidth="1GiB")
    assert read.read_bandwidth == 200 * 10**6 and read.write_bandwidth == 2**30
    plain = settings(backend=" File ", read_bandwidth=None, read_latency_ms=5)
    assert plain.backend == "file" and plain.backend_extra == {}
    assert plain.read_bandwidth is None and plain.read_latency_ms == 5.0
    assert plain.write_latency_ms == 0.0 and plain.write_bandwidth is None


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "throttled storage: backend is required: the name of the backend to wrap"),
    ({"backend": "nfs"}, "backend must name an L3 storage backend to wrap .*got 'nfs'"),
    ({"backend": "throttled"}, "backend must name the backend to wrap, not 'throttled'"),
    ({"backend": "file", "read_latency": 5}, r"unknown extra-config key\(s\) read_latency"),
    ({"backend": "file", "read_latency_ms": -1}, "read_latency_ms must be a number >= 0"),
    ({"backend": "file", "write_bandwidth": 0}, "write_bandwidth must be > 0 bytes per second"),
    ({"backend": "file", "read_bandwidth": "fast"}, "read_bandwidth must be a size in bytes"),
    ({"backend": "file", "backend_extra": "path=/x"}, "backend_extra must be the wrapped"),
])
def test_settings_errors_name_the_key_and_what_to_give(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(StorageError, match=message):
        settings(**extra)


def test_by_name_it_wraps_the_named_backend_with_its_own_extra_config(tmp_path: Path) -> None:
    backend = create_storage_backend("throttled", {
        "backend": "file", "backend_extra": {"path": str(tmp_path), "max_bytes": "1MiB"},
        "read_latency_ms": 2, "read_bandwidth": "200MB",
    })
    assert isinstance(backend, ThrottledBackend) and isinstance(backend.inner, FileBackend)
    assert backend.inner.root == tmp_path and backend.inner.max_bytes == 2**20
    assert backend.read_link.latency_s == pytest.approx(0.002)
    assert backend.read_link.bandwidth == 200e6 and backend.write_link.bandwidth is None
    # The wrapped backend's own errors come through as they are.
    with pytest.raises(StorageError, match=r"file storage: unknown extra-config key.*max_byte"):
        create_storage_backend("throttled", {"backend": "file", "backend_extra": {"max_byte": 1}})


def test_an_injected_backend_is_used_even_when_empty(tmp_path: Path) -> None:
    """An empty file backend is falsy (its __len__ counts pages); it is still the one used."""
    inner = FileBackend({"path": str(tmp_path)})
    backend = ThrottledBackend({"backend": "file"}, inner=inner)
    assert backend.inner is inner
