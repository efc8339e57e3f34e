"""The observed L3 read time and the per-1K-token prefetch allowance it gives under "auto"."""

from __future__ import annotations

import pytest

from hicache.storage.bandwidth import ReadTimeEstimate
from hicache.storage.config import StorageConfig


def test_no_estimate_until_enough_reads_then_the_first_ones_average() -> None:
    estimate = ReadTimeEstimate(page_size=16, weight=0.5, min_samples=2, safety_factor=3.0)
    estimate.observe(num_pages=10, seconds=0.1)  # 10 ms a page
    assert estimate.seconds_per_page is None and estimate.allowance_per_ki_token_s() is None
    estimate.observe(num_pages=4, seconds=0.12)  # 30 ms a page
    assert estimate.num_samples == 2
    assert estimate.seconds_per_page == pytest.approx(0.02)  # 10 + 0.5 x (30 - 10)
    # 1024 tokens = 64 pages of 16 tokens; three times the observed time.
    assert estimate.allowance_per_ki_token_s() == pytest.approx(3.0 * 0.02 * 64)


def test_the_average_follows_a_store_that_slows_down() -> None:
    estimate = ReadTimeEstimate(page_size=1, weight=0.25, min_samples=1, safety_factor=2.0)
    for _ in range(5):
        estimate.observe(8, 8 * 0.001)
    assert estimate.seconds_per_page == pytest.approx(0.001)
    for _ in range(30):
        estimate.observe(8, 8 * 0.010)
    per_page = estimate.seconds_per_page
    assert per_page is not None and per_page == pytest.approx(0.010, rel=0.01)
    assert estimate.allowance_per_ki_token_s() == pytest.approx(2.0 * per_page * 1024)


def test_reads_that_landed_nothing_teach_nothing() -> None:
    estimate = ReadTimeEstimate(page_size=4, min_samples=1)
    estimate.observe(num_pages=0, seconds=2.0)  # a miss on the first page, a refused call
    assert estimate.num_samples == 0 and estimate.seconds_per_page is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"page_size": 0}, "page_size"), ({"page_size": 4, "weight": 0.0}, "weight"),
])
def test_bad_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReadTimeEstimate(**kwargs)  # type: ignore[arg-type]


def test_the_config_uses_the_estimate_only_under_auto_and_caps_the_timeout() -> None:
    auto = StorageConfig(prefetch_timeout_per_ki_token="auto", prefetch_timeout_base=1.0,
                         prefetch_timeout_max=20.0)
    assert auto.auto_prefetch_timeout
    # No estimate yet: the 0.1 s default.
    assert auto.per_ki_token_s(None) == 0.1
    assert auto.prefetch_timeout(2048) == pytest.approx(1.2)
    assert auto.prefetch_timeout(2048, 4.0) == pytest.approx(9.0)
    assert auto.prefetch_timeout(10 * 1024, 4.0) == 20.0  # still capped
    fixed = StorageConfig(prefetch_timeout_per_ki_token=0.5, prefetch_timeout_base=1.0)
    assert not fixed.auto_prefetch_timeout
    assert fixed.prefetch_timeout(2048, 4.0) == pytest.approx(2.0)  # the number wins


def test_the_same_reads_fit_the_store_latency_and_bandwidth() -> None:
    page_bytes = 1 << 20
    estimate = ReadTimeEstimate(page_size=16, page_bytes=page_bytes)
    latency, bandwidth = 0.004, 200e6  # 4 ms a call, 200 MB/s
    for pages in (2, 8, 32):
        estimate.observe(pages, latency + pages * page_bytes / bandwidth)
    assert estimate.read_cost.latency_s == pytest.approx(latency, rel=1e-4)
    assert estimate.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-4)
    assert estimate.predict_read(64) == pytest.approx(latency + 64 * page_bytes / bandwidth,
                                                      rel=1e-4)
    # The allowance is still the average seconds per page, as before.
    assert estimate.seconds_per_page is not None


def test_without_page_bytes_or_enough_reads_the_read_cost_is_unknown() -> None:
    estimate = ReadTimeEstimate(page_size=16)
    for _ in range(5):
        estimate.observe(4, 0.01)
    assert estimate.predict_read(4) is None and estimate.bandwidth_bytes_per_s is None
    sized = ReadTimeEstimate(page_size=16, page_bytes=1024)
    sized.observe(4, 0.01)
    sized.observe(4, 0.01)
    assert sized.predict_read(4) is None
