"""The online estimators recover known costs from synthetic samples, stay unknown below
their minimum, follow a change of regime and reject nonsense samples."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from hicache.estimators import (
    NonNegativeFit,
    PrefillEstimate,
    TransferEstimate,
    attention_pairs,
    bytes_transfer_estimate,
)

# A step: 2 ms fixed, 50 us per token, 2 ns per attention pair, 0.1 ms per decode row.
STEP, PER_TOKEN, PER_PAIR, PER_ROW = 2e-3, 5e-5, 2e-9, 1e-4


def true_step(new: int, context: int, rows: int) -> float:
    return STEP + PER_TOKEN * new + PER_PAIR * attention_pairs(new, context) + PER_ROW * rows


def feed_prefill(est: PrefillEstimate, n: int, rng: random.Random, noise: float = 0.0,
                 cost: Callable[[int, int, int], float] = true_step) -> None:
    for _ in range(n):
        new, context, rows = rng.randint(16, 4096), rng.randint(0, 8192), rng.randint(0, 32)
        seconds = cost(new, context, rows) * (1 + noise * rng.uniform(-1, 1))
        est.observe(new, attention_pairs(new, context), rows, seconds)


def test_attention_pairs_counts_causal_query_key_pairs() -> None:
    assert attention_pairs(1, 0) == 1
    assert attention_pairs(3, 0) == 6  # 1 + 2 + 3
    assert attention_pairs(2, 10) == 11 + 12


def test_prefill_recovers_known_coefficients() -> None:
    est = PrefillEstimate()
    feed_prefill(est, 60, random.Random(1))
    coef = est.coefficients()
    assert coef is not None
    assert coef["step_seconds"] == pytest.approx(STEP, rel=1e-4)
    assert coef["seconds_per_token"] == pytest.approx(PER_TOKEN, rel=1e-4)
    assert coef["seconds_per_pair"] == pytest.approx(PER_PAIR, rel=1e-4)
    assert coef["seconds_per_decode_row"] == pytest.approx(PER_ROW, rel=1e-4)
    assert est.predict(1024) == pytest.approx(true_step(1024, 0, 0), rel=1e-4)
    assert est.predict(512, context=4096, decode_rows=8) == pytest.approx(
        true_step(512, 4096, 8), rel=1e-4)


def test_prefill_with_noise_stays_close() -> None:
    est = PrefillEstimate()
    feed_prefill(est, 300, random.Random(2), noise=0.1)
    predicted = est.predict(2048, context=2048)
    assert predicted is not None
    assert predicted == pytest.approx(true_step(2048, 2048, 0), rel=0.1)


def test_prefill_unknown_below_min_samples() -> None:
    est = PrefillEstimate(min_samples=8)
    feed_prefill(est, 7, random.Random(3))
    assert est.predict(1024) is None
    assert est.predict_prompt(4096) is None
    assert est.coefficients() is None
    feed_prefill(est, 1, random.Random(4))
    assert est.predict(1024) is not None


def test_prefill_follows_a_change_of_regime() -> None:
    est = PrefillEstimate()
    rng = random.Random(5)
    feed_prefill(est, 200, rng)
    feed_prefill(est, 200, rng, cost=lambda n, c, r: 3 * true_step(n, c, r))
    predicted = est.predict(1024, context=1024)
    assert predicted == pytest.approx(3 * true_step(1024, 1024, 0), rel=0.01)


def test_one_stalled_step_moves_the_prefill_fit_little() -> None:
    moved: dict[float | None, float] = {}
    for clip in (4.0, None):
        est = PrefillEstimate(clip=clip)
        feed_prefill(est, 100, random.Random(7))
        before = est.predict(1024, context=1024)
        est.observe(1024, attention_pairs(1024, 1024), 0, 100 * true_step(1024, 1024, 0))
        after = est.predict(1024, context=1024)
        assert before is not None and after is not None
        moved[clip] = after / before
    assert moved[4.0] < 1.3 < 3 < moved[None]


def test_prefill_follows_a_tenfold_slowdown_despite_the_clip() -> None:
    est = PrefillEstimate()
    rng = random.Random(8)
    feed_prefill(est, 100, rng)
    feed_prefill(est, 300, rng, cost=lambda n, c, r: 10 * true_step(n, c, r))
    predicted = est.predict(1024, context=1024)
    assert predicted == pytest.approx(10 * true_step(1024, 1024, 0), rel=0.01)


def test_prefill_rejects_nonsense_samples() -> None:
    est = PrefillEstimate(min_samples=1)
    for new, seconds in ((100, 0.0), (100, -1.0), (100, math.nan), (100, math.inf), (0, 1.0)):
        assert not est.observe(new, attention_pairs(new, 0), 0, seconds)
    assert not est.observe(100, -5, 0, 1.0)
    assert est.num_samples == 0
    assert est.fit.num_rejected == 6
    assert est.predict(100) is None


def test_prefill_of_one_shape_still_predicts_positive_and_exact_there() -> None:
    # A server seeing one prompt size cannot separate the terms, but its own size is right.
    est = PrefillEstimate()
    for _ in range(10):
        est.observe(256, attention_pairs(256, 0), 0, 0.05)
    assert est.predict(256) == pytest.approx(0.05, rel=1e-6)
    predicted = est.predict(4096)
    assert predicted is not None and predicted > 0


def test_prompt_prediction_sums_its_chunks() -> None:
    est = PrefillEstimate()
    feed_prefill(est, 60, random.Random(6))
    whole = est.predict_prompt(4096, chunk=1024)
    chunks = sum(true_step(1024, c, 0) for c in (0, 1024, 2048, 3072))
    assert whole == pytest.approx(chunks, rel=1e-4)
    assert est.predict_prompt(4096) == pytest.approx(true_step(4096, 0, 0), rel=1e-4)


def test_coefficients_never_negative() -> None:
    # Time falling with size is no cost law: the fit keeps the intercept, no negative slope.
    fit = NonNegativeFit(2, min_samples=2)
    for size in range(1, 20):
        fit.observe((1.0, float(size)), 1.0 / size)
    coef = fit.coefficients()
    assert coef is not None and min(coef) >= 0
    far = fit.predict((1.0, 100.0))
    assert far is not None and far > 0


def test_transfer_recovers_latency_and_bandwidth() -> None:
    est = bytes_transfer_estimate()
    latency, bandwidth = 2e-3, 500e6  # 2 ms per call, 500 MB/s
    for pages in (1, 4, 16, 64, 3, 32):
        size = pages * 1_179_648
        est.observe(size, latency + size / bandwidth)
    assert est.latency_s == pytest.approx(latency, rel=1e-4)
    per_byte = est.seconds_per_unit
    assert per_byte is not None and 1 / per_byte == pytest.approx(bandwidth, rel=1e-4)
    assert est.predict(1e6) == pytest.approx(latency + 1e6 / bandwidth, rel=1e-4)


def test_transfer_unknown_below_min_and_rejects_nonsense() -> None:
    est = TransferEstimate(min_samples=3)
    assert not est.observe(0, 1.0)
    assert not est.observe(10, 0.0)
    assert not est.observe(10, -1.0)
    est.observe(10, 0.1)
    est.observe(20, 0.2)
    assert est.predict(10) is None and est.latency_s is None
    est.observe(30, 0.3)
    assert est.predict(40) == pytest.approx(0.4, rel=1e-6)
    assert est.fit.num_rejected == 3


def test_transfer_follows_a_slower_store() -> None:
    est = TransferEstimate()
    for i in range(100):
        est.observe(1 + i % 8, 0.001 * (1 + i % 8))
    for i in range(300):  # 0.97 ** 300: the old regime weighs 1e-4
        est.observe(1 + i % 8, 0.05 + 0.01 * (1 + i % 8))
    assert est.latency_s == pytest.approx(0.05, rel=0.01)
    assert est.seconds_per_unit == pytest.approx(0.01, rel=0.01)


def test_transfer_follows_a_throttled_path_within_two_samples() -> None:
    # A hundred loads at 1 ms a page, then the path slows tenfold: without the restart the
    # forgetting would need dozens of samples; a load planned on the old speed would be
    # priced ten times too cheap.
    est = TransferEstimate()
    for i in range(100):
        est.observe(1 + i % 8, 0.001 * (1 + i % 8))
    est.observe(16, 0.16)
    est.observe(8, 0.08)
    assert est.fit.num_restarts >= 1
    predicted = est.predict(16)
    assert predicted is not None and 0.16 / 1.5 <= predicted <= 0.16 * 1.5
    # And back: the path speeds up again.
    est.observe(16, 0.016)
    est.observe(8, 0.008)
    predicted = est.predict(16)
    assert predicted is not None and 0.016 / 1.5 <= predicted <= 0.016 * 1.5


def test_a_transfer_near_its_prediction_keeps_the_history() -> None:
    est = TransferEstimate()
    for i in range(20):
        est.observe(1 + i % 8, 0.001 * (1 + i % 8))
    est.observe(8, 0.008 * 2.5)  # slower, but within the restart factor
    assert est.fit.num_restarts == 0


def test_fit_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        NonNegativeFit(0)
    with pytest.raises(ValueError):
        NonNegativeFit(2, forget=0)
    with pytest.raises(ValueError):
        NonNegativeFit(2, min_samples=0)
