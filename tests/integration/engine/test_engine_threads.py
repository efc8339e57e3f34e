"""torch's intra-op threads: the default, and the count the engine's forwards run with."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from hicache.engine.engine import Engine
from hicache.engine.threads import adaptive_range, default_num_threads, resolve_num_threads
from tests.engine_helpers import on_scheduler, run


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # process-wide: leave the next tests what they had


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_a_core_to_the_rest_of_the_process(cores: int, threads: int) -> None:
    assert default_num_threads(cores) == threads


def test_given_count_wins_then_omp_num_threads_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolve_num_threads(None) == default_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch made of the variable at import
    assert resolve_num_threads(None) == 3
    assert resolve_num_threads(2) == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_the_scheduler_thread_runs_with_the_configured_count(
    threads: int, make_engine: Callable[..., Engine]
) -> None:
    # Another count first, so that the engine must change it.
    torch.set_num_threads(3 - threads)
    engine = make_engine("--num-threads", str(threads))
    assert engine.num_threads == threads
    assert torch.get_num_threads() == threads  # process-wide
    assert on_scheduler(engine, torch.get_num_threads) == threads
    assert len(run(engine, [1, 2, 3], max_new_tokens=2).token_ids) == 2


def test_without_the_flag_the_engine_applies_the_default(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(default_num_threads() + 1)
    engine = make_engine(governed=True)
    # On 2+ cores the engine's count starts at every core, then follows the governor
    # (test_thread_governor.py); on one core it is the default.
    span = adaptive_range(None, "cpu")
    expected = span[1] if span is not None else default_num_threads()
    assert on_scheduler(engine, torch.get_num_threads) == expected
