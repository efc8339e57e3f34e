"""The prompt tokens a step carries beside decode rows (``step_budget.py``): cut to fit the
decode delay while decodes wait, the full chunk when none do, never below the floor."""

from __future__ import annotations

import pytest

from hicache.engine.config import ConfigError, SchedulingConfig
from hicache.engine.step_budget import (
    MIN_CHUNK_TOKENS,
    decode_step_cost,
    prefill_budget,
    prompt_cost,
)
from hicache.estimators import PrefillCoefficients

# 0.1 ms per token, a little attention on top: 256 tokens cold ~ 26 ms.
COEF = PrefillCoefficients(step_seconds=0.01, seconds_per_token=1e-4,
                           seconds_per_pair=1e-8, seconds_per_decode_row=1e-3)


def test_a_cold_only_queue_keeps_the_full_chunk() -> None:
    assert prefill_budget(COEF, 256, decode_rows=0, delay_s=0.001) == 256


def test_no_delay_or_no_fit_keeps_the_full_chunk() -> None:
    assert prefill_budget(COEF, 256, decode_rows=4, delay_s=None) == 256
    assert prefill_budget(None, 256, decode_rows=4, delay_s=0.001) == 256


def test_decodes_waiting_cut_the_chunk_to_the_largest_that_fits_the_delay() -> None:
    delay = 0.005
    n = prefill_budget(COEF, 256, decode_rows=4, delay_s=delay)
    assert MIN_CHUNK_TOKENS <= n < 256
    assert prompt_cost(COEF, n, 0) <= delay < prompt_cost(COEF, n + 1, 0)
    assert n == 49  # 1e-4 * 49 + 1e-8 * 49 * 50 / 2 <= 5 ms; 50 tokens exceed it


def test_a_longer_context_gets_fewer_tokens_for_the_same_delay() -> None:
    cold = prefill_budget(COEF, 256, decode_rows=1, delay_s=0.005)
    deep = prefill_budget(COEF, 256, decode_rows=1, delay_s=0.005, context=20_000)
    assert deep < cold
    assert prompt_cost(COEF, deep, 20_000) <= 0.005 < prompt_cost(COEF, deep + 1, 20_000)


def test_the_chunk_grows_back_when_the_delay_allows_it() -> None:
    assert prefill_budget(COEF, 256, decode_rows=8, delay_s=1.0) == 256


@pytest.mark.parametrize("chunk", [8, 256])
def test_a_tight_delay_still_lets_prompts_progress(chunk: int) -> None:
    # Prompts never stall behind decodes: at least the floor (or the chunk, if smaller).
    assert prefill_budget(COEF, chunk, decode_rows=32, delay_s=1e-9) == min(
        MIN_CHUNK_TOKENS, chunk)


def test_the_delay_flag_reaches_the_limits_in_seconds_and_is_validated() -> None:
    limits = SchedulingConfig(max_decode_delay_ms=20).scheduler_limits(4096, "cpu")
    assert limits.max_decode_delay_s == pytest.approx(0.02)
    assert SchedulingConfig().scheduler_limits(4096, "cpu").max_decode_delay_s is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--max-decode-delay-ms"):
            SchedulingConfig(max_decode_delay_ms=bad)


def test_a_delay_factor_prices_the_delay_from_the_decode_rows_own_step() -> None:
    # 4 rows alone: 10 ms + 4 x 1 ms = 14 ms; half of it, 7 ms, buys what 7 ms does.
    assert decode_step_cost(COEF, 4) == pytest.approx(0.014)
    by_factor = prefill_budget(COEF, 256, decode_rows=4, delay_s=None, delay_factor=0.5)
    assert by_factor == prefill_budget(COEF, 256, decode_rows=4, delay_s=0.007)
    # More rows make a longer step, so the same factor allows more prompt tokens.
    assert prefill_budget(COEF, 256, decode_rows=8, delay_s=None, delay_factor=0.5) > by_factor
    # Both given: the smaller delay applies.
    assert prefill_budget(COEF, 256, decode_rows=4, delay_s=0.003, delay_factor=0.5) == (
        prefill_budget(COEF, 256, decode_rows=4, delay_s=0.003))
    assert prefill_budget(COEF, 256, decode_rows=0, delay_s=None, delay_factor=0.5) == 256


def test_the_delay_factor_flag_reaches_the_limits_and_is_validated() -> None:
    limits = SchedulingConfig(max_decode_delay_factor=2).scheduler_limits(4096, "cpu")
    assert limits.max_decode_delay_factor == 2 and limits.max_decode_delay_s is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="--max-decode-delay-factor"):
            SchedulingConfig(max_decode_delay_factor=bad)
