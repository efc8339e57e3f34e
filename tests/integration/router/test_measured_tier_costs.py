"""The default policy's tier costs, measured: the router reads them from what the workers
report (a fake worker on loopback) and follows them as they change."""

from __future__ import annotations

import pytest

from hicache.router.types import TierCosts
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import running_router
from tests.waiting import wait_until


def test_measured_tier_costs_follow_what_the_workers_report() -> None:
    # 1000 prompt tokens/s and 1 ms per host page at page 4: recomputing a page takes
    # 4 ms, loading it 1 ms, so a host page costs a quarter of recomputing it.
    counters = {"engine_num_prefill_step_tokens": 4000, "engine_prefill_step_seconds": 4.0,
                "cache_num_loaded_pages": 100, "cache_load_seconds": 0.1}
    worker = FakeWorker(extra_info={"internal_states": [counters]})
    costs: dict[str, TierCosts] = {}
    with fake_workers(worker) as (url,), running_router([url], tier_costs=costs):
        assert wait_until(lambda: url in costs, timeout_s=5)
        assert costs[url].host == pytest.approx(0.25)
        counters["cache_load_seconds"] = 0.2  # slower loads: the next probes see it
        assert wait_until(lambda: costs[url].host == pytest.approx(0.5), timeout_s=5)
