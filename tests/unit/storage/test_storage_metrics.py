"""StorageMetrics.total: the L3 counters of a tensor-parallel group's ranks (one store
each) add up field by field, failures by reason."""

from __future__ import annotations

from dataclasses import fields

from hicache.storage.controller import StorageMetrics


def test_total_sums_every_field_and_failures_by_reason() -> None:
    a = StorageMetrics(prefetch_queries=2, prefetch_pages_found=10, prefetch_seconds=0.5,
                       stalled_calls=1, failures={"timeout": 1, "breaker_open": 3})
    b = StorageMetrics(prefetch_queries=2, prefetch_pages_found=8, prefetch_seconds=0.25,
                       backup_pages_stored=4, failures={"timeout": 2})
    total = StorageMetrics.total([a, b])
    assert total == StorageMetrics(
        prefetch_queries=4, prefetch_pages_found=18, prefetch_seconds=0.75,
        backup_pages_stored=4, stalled_calls=1, failures={"timeout": 3, "breaker_open": 3},
    )
    assert a.failures == {"timeout": 1, "breaker_open": 3}  # the parts are left alone
    # Every numeric field takes part (a field added later is summed too).
    ones = StorageMetrics(**{f.name: 1 for f in fields(StorageMetrics) if f.name != "failures"})
    doubled = StorageMetrics.total([ones, ones])
    assert all(getattr(doubled, f.name) == 2 for f in fields(StorageMetrics)
               if f.name != "failures")
    assert StorageMetrics.total([]) == StorageMetrics()
