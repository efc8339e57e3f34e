"""What an admission round may wait for held requests' L3 reads (``prefetcher.read_wait_s``):
a share of the next step's predicted time, so that a read landing within it saves its
request that step at less cost to the requests running beside it."""

from __future__ import annotations

import pytest

from hicache.engine.prefetcher import MAX_READ_WAIT_S, read_wait_s
from hicache.engine.reuse_plan import CostSnapshot
from hicache.engine.step_budget import StepCosts
from hicache.estimators import PrefillCoefficients

# A step costs 10 ms, a prompt token 1 ms, a decode row beside a prompt 2 ms.
FIT = PrefillCoefficients(0.01, 1e-3, 0.0, 2e-3)
COSTS = CostSnapshot(prefill=FIT, chunk_tokens=512, step=StepCosts(0.04, 1e-3))


def test_nothing_running_waits_nothing() -> None:
    # An idle engine holds nobody up and polls its reads anyway.
    assert read_wait_s(COSTS, 0, 0, 0) == 0.0


def test_a_prompt_step_is_shared_with_the_requests_it_delays() -> None:
    # 100 prompt tokens beside 2 decode rows: 10 + 100 + 4 ms, over 3 running + the held one.
    assert read_wait_s(COSTS, 100, 2, 3) == pytest.approx(0.114 / 4)
    # More requests running: each loses the wait, so less of it pays.
    assert read_wait_s(COSTS, 100, 2, 7) < read_wait_s(COSTS, 100, 2, 3)


def test_a_decode_step_is_priced_from_the_measured_decode_step() -> None:
    assert read_wait_s(COSTS, 0, 4, 4) == pytest.approx(0.04 / 5)


def test_a_long_step_is_capped() -> None:
    assert read_wait_s(COSTS, 100_000, 0, 1) == MAX_READ_WAIT_S


def test_unknown_costs_wait_nothing() -> None:
    unknown = CostSnapshot(prefill=None, chunk_tokens=512)
    assert read_wait_s(unknown, 100, 0, 1) == 0.0
    assert read_wait_s(unknown, 0, 3, 3) == 0.0
