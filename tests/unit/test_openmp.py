"""Helper threads run torch's CPU ops on themselves alone (``hicache.openmp``), whatever the
engine's own threads are set to, before or after."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache.controller.executor import ThreadExecutor
from hicache.openmp import _openmp_runtime, one_openmp_thread_here

pytestmark = pytest.mark.skipif(_openmp_runtime() is None, reason="torch without OpenMP here")


@pytest.fixture()
def two_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_helper_thread_uses_one_thread_and_leaves_the_others_alone(two_threads: object) -> None:
    seen: dict[str, int] = {}
    ready, go = threading.Event(), threading.Event()

    def helper() -> None:
        one_openmp_thread_here()
        seen["first"] = torch.get_num_threads()
        ready.set()
        go.wait(10)
        torch.ones(1 << 20).add_(1)  # a parallel op: it must not take a team
        seen["after"] = torch.get_num_threads()

    thread = threading.Thread(target=helper)
    thread.start()
    assert ready.wait(10)
    torch.set_num_threads(2)  # the engine sets its count after the helper started (the governor)
    go.set()
    thread.join(10)
    assert seen == {"first": 1, "after": 1}
    assert torch.get_num_threads() == 2  # the calling thread kept its count


def test_the_cache_controllers_executor_threads_use_one_thread(two_threads: object) -> None:
    executor = ThreadExecutor("test-executor")
    seen: list[int] = []
    try:
        executor.submit(lambda: seen.append(torch.get_num_threads())).wait()
    finally:
        executor.close()
    assert seen == [1]
    assert torch.get_num_threads() == 2
