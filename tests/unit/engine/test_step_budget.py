"""The prompt tokens a step carries beside decode rows (``step_budget.py``): cut to fit the
decode delay while decodes wait, the full chunk when none do, never below the floor; and
the step costs it prices with, measured from steps."""

from __future__ import annotations

import pytest

from hicache.engine.config import ConfigError, SchedulingConfig
from hicache.engine.step_budget import (
    DECODE_SAMPLE_EVERY,
    MIN_CHUNK_TOKENS,
    StepCosts,
    StepCostTracker,
    prefill_budget,
)

# A decode-only step of 14 ms; 0.1 ms per prompt token.
COSTS = StepCosts(decode_step_s=0.014, prompt_token_s=1e-4)


def test_a_cold_only_queue_keeps_the_full_chunk() -> None:
    assert prefill_budget(COSTS, 256, decode_rows=0, delay_s=0.001) == 256


def test_no_delay_or_no_costs_keeps_the_full_chunk() -> None:
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=None) == 256
    assert prefill_budget(None, 256, decode_rows=4, delay_s=0.001) == 256


def test_decodes_waiting_cut_the_chunk_to_what_the_delay_buys() -> None:
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=0.005) == 50
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=0.00505) == 50


def test_the_chunk_grows_back_when_the_delay_allows_it() -> None:
    assert prefill_budget(COSTS, 256, decode_rows=8, delay_s=1.0) == 256


@pytest.mark.parametrize("chunk", [8, 256])
def test_a_tight_delay_still_lets_prompts_progress(chunk: int) -> None:
    # Prompts never stall behind decodes: at least the floor (or the chunk, if smaller).
    assert prefill_budget(COSTS, chunk, decode_rows=32, delay_s=1e-9) == min(
        MIN_CHUNK_TOKENS, chunk)


def test_a_delay_factor_prices_the_delay_from_a_decode_only_step() -> None:
    # Half a 14 ms decode step: 7 ms, 70 tokens.
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=None, delay_factor=0.5) == 70
    # Both given: the smaller delay applies.
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=0.003, delay_factor=0.5) == 30
    assert prefill_budget(COSTS, 256, decode_rows=4, delay_s=0.009, delay_factor=0.5) == 70
    assert prefill_budget(COSTS, 256, decode_rows=0, delay_s=None, delay_factor=0.5) == 256


def test_the_tracker_measures_a_decode_step_and_a_prompt_tokens_share() -> None:
    tracker = StepCostTracker(weight=0.5)
    assert tracker.snapshot() is None
    # No decode-only step yet: a prefill step alone seeds a token's share with the whole
    # step per token (an upper bound), and the budget still has nothing to price with.
    tracker.observe(256, 0, 0.512)
    seeded = tracker.snapshot()
    assert seeded is not None and seeded.decode_step_s is None
    assert seeded.prompt_token_s == pytest.approx(2e-3)
    assert seeded.wants_decode_sample()
    assert prefill_budget(seeded, 256, decode_rows=4, delay_s=0.001) == 256
    tracker.observe(0, 4, 0.010)
    tracker.observe(0, 4, 0.020)  # the moving average: halfway
    assert tracker.decode_step_s == pytest.approx(0.015)
    tracker.observe(100, 4, 0.115)  # 100 ms beyond a decode step: 1 ms per token
    costs = tracker.snapshot()
    assert costs is not None
    assert costs.decode_step_s == pytest.approx(0.015)
    assert costs.prompt_token_s == pytest.approx(0.5 * 2e-3 + 0.5 * 1e-3)
    tracker.observe(0, 0, 5.0)  # a step of nothing is no sample
    assert tracker.decode_step_s == pytest.approx(0.015)


def test_the_tracker_asks_for_a_decode_only_step_when_its_sample_is_old() -> None:
    # While prompts keep arriving every step with decode rows carries prompt tokens too:
    # the decode step's cost would never be measured again without a step kept for it.
    tracker = StepCostTracker()
    tracker.observe(0, 2, 0.010)
    costs = tracker.snapshot()
    assert costs is not None and not costs.wants_decode_sample()
    for k in range(1, DECODE_SAMPLE_EVERY + 1):
        tracker.observe(32, 2, 0.020)
        costs = tracker.snapshot()
        assert costs is not None and costs.steps_since_decode == k
        assert costs.wants_decode_sample() == (k >= DECODE_SAMPLE_EVERY)
    tracker.observe(64, 0, 0.100)  # a prefill step without decode rows does not count
    assert tracker.steps_since_decode == DECODE_SAMPLE_EVERY
    tracker.observe(0, 5, 0.030)
    costs = tracker.snapshot()
    assert costs is not None and costs.steps_since_decode == 0
    assert not costs.wants_decode_sample()


def test_the_delay_flags_reach_the_limits_and_are_validated() -> None:
    limits = SchedulingConfig(max_decode_delay_ms=20).scheduler_limits(4096, "cpu")
    assert limits.max_decode_delay_s == pytest.approx(0.02)
    assert limits.max_decode_delay_factor is None
    limits = SchedulingConfig(max_decode_delay_factor=2).scheduler_limits(4096, "cpu")
    assert limits.max_decode_delay_factor == 2 and limits.max_decode_delay_s is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--max-decode-delay-ms"):
            SchedulingConfig(max_decode_delay_ms=bad)
        with pytest.raises(ConfigError, match="--max-decode-delay-factor"):
            SchedulingConfig(max_decode_delay_factor=bad)
