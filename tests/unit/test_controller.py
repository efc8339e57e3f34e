"""CacheController and executors on CPU: ordering, acknowledgement, layer-wise readiness."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hicache.config import MemLayout
from hicache.controller.controller import CacheController
from hicache.controller.executor import ThreadExecutor
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.transfer.base import IOBackend
from tests.waiting import wait_until

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)


class GatedBackend(IOBackend):
    """Copies like a reference backend, but each copy waits for a gate to open."""

    name = "gated"

    def __init__(self, host: HostPool, device: DevicePool) -> None:
        super().__init__(host, device)
        self.gates: dict[tuple[str, int | None], threading.Event] = {}
        self.fail_next_store = False

    def gate(self, kind: str, layer: int | None) -> threading.Event:
        return self.gates.setdefault((kind, layer), threading.Event())

    def load(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        assert self.gate("load", layer).wait(10)
        self.device.pages[device_pages, layer] = self.host.pages[host_pages, layer]

    def store(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor, layer: int | None = None
    ) -> None:
        assert self.gate("store", layer).wait(10)
        if self.fail_next_store:
            self.fail_next_store = False
            raise OSError("simulated copy failure")
        self.host.pages[host_pages] = self.device.pages[device_pages]


@pytest.fixture()
def setup():
    host = HostPool(GEOMETRY, 8, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    device = DevicePool(GEOMETRY, 4, 2)
    backend = GatedBackend(host, device)
    controller = CacheController(backend)
    controller.start()
    yield controller, backend
    for event in backend.gates.values():
        event.set()
    controller.stop()


def test_writes_are_acknowledged_in_order_and_only_once_landed(setup) -> None:
    controller, backend = setup
    backend.device.pages.normal_()
    controller.write(np.array([0, 1]), np.array([5, 6]), token=11)
    controller.write(np.array([2]), np.array([7]), token=12)
    # Time for a wrong acknowledgement to show, not a wait for an event: the store is held
    # at its gate, so nothing may have landed however long this is.
    time.sleep(0.05)
    assert controller.poll_writes() == []  # nothing has landed yet
    backend.gate("store", None).set()
    assert wait_until(lambda: controller._writes[-1].completion.query())
    assert controller.poll_writes() == [11, 12]
    assert torch.equal(backend.host.pages[[5, 6, 7]], backend.device.pages[[0, 1, 2]])
    assert controller.num_written_pages == 3


def test_landed_writes_are_counted_then_taken_as_agreed(setup) -> None:
    """Tensor-parallel ranks count landed writes, agree on a count, then take that many."""
    controller, backend = setup
    for token in (21, 22, 23):
        controller.write(np.array([token - 21]), np.array([token - 20]), token=token)
    # Time for a wrong acknowledgement to show, not a wait for an event: the store is held
    # at its gate, so nothing may have landed however long this is.
    time.sleep(0.05)
    assert controller.num_landed_writes() == 0
    assert controller.take_writes(0) == []
    backend.gate("store", None).set()
    assert wait_until(lambda: controller.num_landed_writes() == 3)
    assert controller.num_pending_writes == 3  # counting acknowledges nothing
    assert controller.take_writes(2) == [21, 22]  # an agreed count below what landed here
    assert controller.num_landed_writes() == 1 and controller.num_pending_writes == 1
    with pytest.raises(ValueError, match="only 1 writes pending"):
        controller.take_writes(2)
    assert controller.poll_writes() == [23]


def test_a_failed_write_is_raised_not_acknowledged(setup) -> None:
    controller, backend = setup
    backend.fail_next_store = True
    backend.gate("store", None).set()
    controller.write(np.array([0]), np.array([1]), token=1)
    with pytest.raises(RuntimeError, match="transfer failed"):
        controller.wait_writes()


def test_loads_become_ready_layer_by_layer(setup) -> None:
    controller, backend = setup
    backend.host.pages.normal_()
    batch = controller.load(np.array([3, 4]), np.array([0, 1]))
    backend.gate("load", 0).set()
    controller.wait_layer(0)  # returns although layers 1.. are still gated
    assert torch.equal(backend.device.pages[[0, 1], 0], backend.host.pages[[3, 4], 0])
    assert not batch.layers[1].query() and not batch.done()
    for layer in range(1, GEOMETRY.num_layers):
        backend.gate("load", layer).set()
    controller.wait_loads()
    assert batch.done()
    assert torch.equal(backend.device.pages[[0, 1]], backend.host.pages[[3, 4]])


def test_a_load_is_one_sample_for_the_cost_model_once_every_layer_landed(setup) -> None:
    controller, backend = setup
    assert controller.take_load_samples() == []
    controller.load(np.array([3, 4, 5]), np.array([0, 1, 2]))
    for layer in range(GEOMETRY.num_layers - 1):
        backend.gate("load", layer).set()
    batch = controller._last_load
    assert batch is not None
    assert wait_until(batch.layers[-2].query), "all but the last layer never landed"
    assert controller.take_load_samples() == []  # the last layer is still gated
    backend.gate("load", GEOMETRY.num_layers - 1).set()
    controller.wait_loads()
    samples = controller.take_load_samples()
    assert len(samples) == 1 and samples[0][0] == 3
    # The copies' whole time, the same the load_seconds counter summed.
    assert 0 < samples[0][1] <= controller.load_seconds
    assert controller.take_load_samples() == []  # taken once


def test_thread_executor_runs_in_order_and_refuses_work_after_close() -> None:
    executor = ThreadExecutor("test")
    seen: list[int] = []
    completions = [executor.submit(lambda i=i: seen.append(i)) for i in range(50)]
    completions[-1].wait()
    assert seen == list(range(50)) and all(c.query() for c in completions)
    executor.close()
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit(lambda: None)


def test_controller_must_be_started() -> None:
    host = HostPool(GEOMETRY, 8, 2, MemLayout.PAGE_FIRST, pin_memory=False)
    controller = CacheController(GatedBackend(host, DevicePool(GEOMETRY, 4, 2)))
    with pytest.raises(RuntimeError, match="not started"):
        controller.write(np.array([0]), np.array([0]), token=0)
