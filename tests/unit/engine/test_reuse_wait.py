"""The ReuseAdvisor holding a request for its L3 prefetch, with the real planner: it waits
while the plan needs pages still to come, cuts the prefetch where computing beats them,
and starts a report only for a request that L3 or the host tier offered something.

The cache, the request and its prefetch handle are stand-ins holding only what the
advisor reads; the costs are a fixed snapshot (``shared_costs``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hicache.config import ReusePolicy
from hicache.engine.cost_model import CostModel
from hicache.engine.reuse import ReuseAdvisor
from hicache.engine.reuse_plan import CostSnapshot, Decision
from hicache.estimators import PrefillCoefficients
from hicache.radix.results import PrefixPeek

PAGE = 16
PROMPT = 321  # 20 whole pages and the last token
PAGES = 20
LINEAR = PrefillCoefficients(1e-3, 1e-3, 0.0, 0.0)  # the prompt computes in ~0.32 s
FAST_READS = CostSnapshot(LINEAR, None, load_latency_s=0.0, load_seconds_per_page=1e-4,
                          read_latency_s=1e-3, read_seconds_per_page=1e-4)
SLOW_READS = CostSnapshot(LINEAR, None, load_latency_s=0.0, load_seconds_per_page=1e-4,
                          read_latency_s=3.0, read_seconds_per_page=1e-4)


def advisor(costs: CostSnapshot, host_pages: int = 0) -> ReuseAdvisor:
    peek = PrefixPeek(0, host_pages, 0, PAGE)
    cache: Any = SimpleNamespace(
        page_size=PAGE, config=SimpleNamespace(reuse_policy=ReusePolicy.COST),
        peek=lambda tokens, extra_key: peek,
        prefetch_landed_tokens=lambda handle: 0,  # nothing read yet
    )
    reuse = ReuseAdvisor(cache, CostModel(), clock=lambda: 100.0)
    reuse.shared_costs = costs
    return reuse


def waiting(found_pages: int | None, host_pages: int = 0) -> Any:
    """A request waiting for its prefetch; ``found_pages`` None: the lookup runs."""
    handle = SimpleNamespace(
        num_found_tokens=-1 if found_pages is None else found_pages * PAGE,
        start_page=host_pages, num_requested_tokens=(PAGES - host_pages) * PAGE,
    )
    return SimpleNamespace(
        prefetch=handle, seq_len=PROMPT, num_retractions=0, reuse_track=None,
        request=SimpleNamespace(extra_key=None), match_key=lambda: list(range(PROMPT - 1)),
    )


def admit(reuse: ReuseAdvisor, req: Any, host_pages: int) -> None:
    """As the scheduler admits it, after its prefetch settled with nothing landed."""
    peek = PrefixPeek(0, host_pages, 0, PAGE)
    limit, plan, costs = reuse.acquire_limit(req, peek, decode_rows=0)
    loaded = host_pages * PAGE if limit is None else limit
    reuse.admitted(req, 0, loaded, plan, costs)


def test_a_hit_worth_reading_is_waited_for() -> None:
    reuse, req = advisor(FAST_READS), waiting(found_pages=PAGES)
    assert reuse.should_wait(req, decode_rows=0)
    assert req.reuse_track is not None and req.reuse_track.first is not None
    assert req.reuse_track.first.decision is Decision.LOAD


def test_a_hit_slower_to_read_than_to_compute_is_cut_and_reported_recomputed() -> None:
    reuse, req = advisor(SLOW_READS), waiting(found_pages=PAGES)
    assert not reuse.should_wait(req, decode_rows=0)
    admit(reuse, req, host_pages=0)
    report = req.reuse_track.report
    assert report is not None and report.decision == Decision.RECOMPUTE.value
    assert report.recomputed_tokens == PAGES * PAGE and report.loaded_tokens == 0


def test_a_pending_lookup_starts_no_report() -> None:
    # Computing the prompt beats even the best the lookup could bring: not held, and, as
    # nothing is known of a hit, no report.
    reuse, req = advisor(SLOW_READS), waiting(found_pages=None)
    assert not reuse.should_wait(req, decode_rows=0)
    assert req.reuse_track is None or not req.reuse_track.offered


def test_a_miss_seen_before_its_answer_is_applied_starts_no_report() -> None:
    # The store's lookup thread sets the count it found before the scheduler applies the
    # answer: for a moment a miss reads as "found 0" while the prefetch is not yet
    # complete. A cold prompt must not get a report (nor count as a decision) for it.
    reuse, req = advisor(FAST_READS), waiting(found_pages=0)
    assert reuse.should_wait(req, decode_rows=0)  # until the answer is applied
    assert req.reuse_track is None or not req.reuse_track.offered
    admit(reuse, req, host_pages=0)
    assert req.reuse_track is None or not req.reuse_track.offered


def test_a_miss_behind_a_host_hit_still_reports_the_host_choice() -> None:
    reuse, req = advisor(FAST_READS, host_pages=4), waiting(found_pages=0, host_pages=4)
    reuse.should_wait(req, decode_rows=0)
    admit(reuse, req, host_pages=4)
    report = req.reuse_track.report
    assert report is not None and report.decision == Decision.LOAD.value
    assert report.loaded_tokens == 4 * PAGE and report.recomputed_tokens == 0
