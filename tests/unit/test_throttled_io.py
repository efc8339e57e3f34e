"""The throttled host->device path: each load waits its latency once and each layer's bytes
at the bandwidth, stores are not delayed, the pages moved are the wrapped backend's, and
it goes onto a cache controller and comes off again. The wait is a recorder: nothing
sleeps."""

from __future__ import annotations

import pytest
import torch

from hicache.config import MemLayout
from hicache.controller.controller import CacheController
from hicache.memory.geometry import KVGeometry
from hicache.testing.throttled_io import (
    LoadThrottle,
    ThrottledIO,
    throttle_loads,
    unthrottle_loads,
)
from hicache.transfer import DirectBackend
from tests.transfer_reference import fill_random, make_pools

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
PAGE = 4
PAGE_BYTES = GEOMETRY.page_bytes(PAGE)


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def throttled(throttle: LoadThrottle) -> tuple[ThrottledIO, list[float]]:
    host, device = make_pools(GEOMETRY, MemLayout.LAYER_FIRST, PAGE, 8, 8)
    waits: list[float] = []
    return ThrottledIO(DirectBackend(host, device), throttle, waits.append), waits


def test_the_delay_is_the_latency_once_plus_the_bytes_at_the_bandwidth() -> None:
    throttle = LoadThrottle(latency_s=0.002, bandwidth=1e6)
    assert throttle.delay_s(1000, first=True) == pytest.approx(0.002 + 0.001)
    assert throttle.delay_s(1000, first=False) == pytest.approx(0.001)
    assert LoadThrottle(0.002).delay_s(10**9, first=False) == 0.0  # no bandwidth limit
    assert LoadThrottle().delay_s(10**9, first=True) == 0.0


@pytest.mark.parametrize("bad", [{"latency_s": -1.0}, {"bandwidth": 0.0}])
def test_a_negative_latency_or_a_bandwidth_of_zero_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LoadThrottle(**bad)


def test_a_layer_wise_load_waits_the_latency_on_its_first_layer_only() -> None:
    bandwidth = 1e6
    io, waits = throttled(LoadThrottle(latency_s=0.005, bandwidth=bandwidth))
    src, dst = pages(1, 2, 3), pages(0, 4, 5)
    for layer in range(GEOMETRY.num_layers):
        io.load(src, dst, layer=layer)
    layer_s = 3 * PAGE_BYTES / GEOMETRY.num_layers / bandwidth
    assert waits == pytest.approx([0.005 + layer_s] + [layer_s] * (GEOMETRY.num_layers - 1))
    # The whole load: the latency plus all its bytes at the bandwidth.
    assert sum(waits) == pytest.approx(0.005 + 3 * PAGE_BYTES / bandwidth)
    assert io.waited_s == pytest.approx(sum(waits))


def test_a_whole_page_load_waits_once_and_stores_and_empty_loads_do_not_wait() -> None:
    io, waits = throttled(LoadThrottle(latency_s=0.005, bandwidth=1e6))
    io.load(pages(1, 2), pages(3, 4))
    assert waits == pytest.approx([0.005 + 2 * PAGE_BYTES / 1e6])
    io.store(pages(3, 4), pages(1, 2))
    io.store(pages(3), pages(6), layer=0)
    io.load(pages(), pages(), layer=0)
    assert len(waits) == 1


def test_the_pages_moved_are_the_wrapped_backends() -> None:
    io, _ = throttled(LoadThrottle(latency_s=0.001, bandwidth=1e9))
    fill_random(io.host.flat, seed=0)
    io.load(pages(2, 5), pages(1, 6))
    for host_page, device_page in ((2, 1), (5, 6)):
        assert torch.equal(io.device.pages[device_page], io.host.pages[host_page])
    fill_random(io.device.flat, seed=1)
    io.store(pages(6), pages(0))
    assert torch.equal(io.host.pages[0], io.device.pages[6])


def test_it_goes_onto_a_controller_and_comes_off_again() -> None:
    host, device = make_pools(GEOMETRY, MemLayout.LAYER_FIRST, PAGE, 8, 8)
    original = DirectBackend(host, device)
    controller = CacheController(original)
    waits: list[float] = []
    wrapper = throttle_loads(controller, LoadThrottle(latency_s=0.001), waits.append)
    assert controller.io is wrapper and wrapper.inner is original
    with pytest.raises(RuntimeError):
        throttle_loads(controller, LoadThrottle())  # one throttle at a time
    unthrottle_loads(controller)
    assert controller.io is original
    unthrottle_loads(controller)  # nothing to take off: no-op
    assert controller.io is original
