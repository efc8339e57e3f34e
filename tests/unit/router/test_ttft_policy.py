"""predicted_ttft: the choice on hand-built overlaps and costs, the terms it reports, and its
fallbacks when a worker has not measured its costs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from hicache.engine.reuse_plan import CostSnapshot
from hicache.estimators import PrefillCoefficients
from hicache.events.messages import KVEventBatch
from hicache.router.live_costs import DEFAULT_SECONDS_PER_TOKEN
from hicache.router.policy import NoWorkerError, ScoringConfig, build_policy
from hicache.router.shared_pool import InMemorySharedPool
from hicache.router.types import RouteDecision, RouteRequest, TierOverlap, WorkerLoad

PAGE = 16
PAGES = 16
PROMPT = PAGES * PAGE + 4  # 16 full pages and a partial one
HASHES = list(range(1000, 1000 + PAGES))
# 1 ms a token, nothing else: recomputing the whole prompt costs 0.26 s, a page 16 ms.
PER_TOKEN = 1e-3


def costs(*, read_per_page: float = 0.005, load_per_page: float = 0.0001,
          per_row: float = 0.0, per_pair: float = 0.0) -> CostSnapshot:
    return CostSnapshot(
        prefill=PrefillCoefficients(0.0, PER_TOKEN, per_pair, per_row), chunk_tokens=None,
        load_latency_s=0.0, load_seconds_per_page=load_per_page,
        read_latency_s=0.0, read_seconds_per_page=read_per_page)


class FixedIndex:
    """Overlaps as given, per worker."""

    def __init__(self, overlaps: Mapping[str, TierOverlap]) -> None:
        self._overlaps = overlaps

    def apply(self, worker: str, batch: KVEventBatch) -> None: ...

    def clear_worker(self, worker: str) -> None: ...

    def remove_worker(self, worker: str) -> None: ...

    def overlaps(self, page_hashes: Sequence[int], workers: Sequence[str],
                 ) -> dict[str, TierOverlap]:
        return {w: self._overlaps.get(w, TierOverlap()) for w in workers}

    def num_pages(self) -> int:
        return 0


def choose(overlaps: Mapping[str, TierOverlap], workers: Sequence[WorkerLoad],
           shared: object = None, prompt: int = PROMPT, score: str = "own") -> RouteDecision:
    policy = build_policy("predicted_ttft", FixedIndex(overlaps), shared,  # type: ignore[arg-type]
                          ScoringConfig(ttft_score=score))
    request = RouteRequest(page_hashes=HASHES, prompt_tokens=prompt, workers=workers,
                           page_size=PAGE)
    return asyncio.run(policy.choose(request, list(range(prompt))))


# A holds the prefix on its device; B holds nothing of it but the shared L3 does.
STICKY = {"A": TierOverlap(gpu=PAGES, host=PAGES, external=PAGES),
          "B": TierOverlap(external=PAGES)}


def test_a_long_queue_loses_to_an_idle_worker_that_reads_the_prefix_from_l3() -> None:
    decision = choose(STICKY, [WorkerLoad("A", queued_prefill_s=1.0, costs=costs()),
                               WorkerLoad("B", costs=costs())])
    assert decision.worker == "B"
    # B: 16 pages read (5 ms) and loaded (0.1 ms) each, then the 4 last tokens computed.
    assert decision.predicted_ttft_s == pytest.approx(PAGES * 0.0051 + 4 * PER_TOKEN)
    assert decision.terms["queue_s"] == 0.0
    assert decision.terms["load_s"] == pytest.approx(PAGES * 0.0051)
    assert decision.terms["cached_tokens"] == PAGES * PAGE
    assert decision.logits["A"] == pytest.approx(1.0 + 4 * PER_TOKEN)
    assert decision.fallbacks == ()


def test_the_sticky_choice_wins_when_its_queue_is_short() -> None:
    decision = choose(STICKY, [WorkerLoad("A", queued_prefill_s=0.05, costs=costs()),
                               WorkerLoad("B", costs=costs())])
    assert decision.worker == "A"
    assert decision.predicted_ttft_s == pytest.approx(0.05 + 4 * PER_TOKEN)
    assert decision.predicted_prefill_s == pytest.approx(4 * PER_TOKEN)
    assert decision.prefill_pages == pytest.approx(4 / PAGE)  # the partial page's tokens


def test_l3_pages_dearer_than_recomputing_are_recomputed() -> None:
    # A page read takes 20 ms, computing it 16 ms: the worker's plan recomputes them all.
    decision = choose({"B": TierOverlap(external=PAGES)},
                      [WorkerLoad("B", costs=costs(read_per_page=0.02))])
    assert decision.terms["cached_tokens"] == 0
    assert decision.predicted_ttft_s == pytest.approx(PROMPT * PER_TOKEN)


def test_host_pages_cost_their_load_and_the_context_makes_tokens_dearer() -> None:
    # With an attention term a token after a long cached prefix costs more than the first.
    priced = costs(per_pair=1e-6)
    on_host = choose({"A": TierOverlap(host=PAGES, external=PAGES)},
                     [WorkerLoad("A", costs=priced)])
    assert on_host.terms["load_s"] == pytest.approx(PAGES * 0.0001)
    cold = choose({}, [WorkerLoad("A", costs=priced)])
    assert cold.predicted_ttft_s > PROMPT * PER_TOKEN  # the pairs on top of the tokens


def test_decoding_requests_slow_the_prefill() -> None:
    busy = choose({}, [WorkerLoad("A", decoding_requests=10, costs=costs(per_row=0.01))])
    assert busy.terms["decode_s"] == pytest.approx(0.1)  # one step, 10 rows of 10 ms
    assert busy.predicted_ttft_s == pytest.approx(PROMPT * PER_TOKEN + 0.1)
    # The idle worker wins against the busy one holding nothing more.
    decision = choose({}, [WorkerLoad("A", decoding_requests=10, costs=costs(per_row=0.01)),
                           WorkerLoad("B", costs=costs(per_row=0.01))])
    assert decision.worker == "B"


def test_ties_go_to_fewer_in_flight_then_registration_order() -> None:
    same = [WorkerLoad("A", active_requests=2, costs=costs()),
            WorkerLoad("B", active_requests=1, costs=costs()),
            WorkerLoad("C", active_requests=1, costs=costs())]
    assert choose({}, same).worker == "B"


def test_a_worker_not_measured_yet_is_priced_with_the_others_median() -> None:
    slow = CostSnapshot(prefill=PrefillCoefficients(0.0, 3e-3, 0.0, 0.0), chunk_tokens=None,
                        load_latency_s=0.0, load_seconds_per_page=0.0,
                        read_latency_s=0.0, read_seconds_per_page=0.0)
    decision = choose({}, [WorkerLoad("A", costs=costs()), WorkerLoad("B", costs=slow),
                           WorkerLoad("C", costs=costs()), WorkerLoad("N")])
    # N's prefill is the median of 1, 3 and 1 ms a token: priced as A and C, and last.
    assert decision.logits["N"] == pytest.approx(PROMPT * PER_TOKEN)
    assert decision.worker == "A"
    lone = choose({}, [WorkerLoad("N", costs=costs()), WorkerLoad("M")])
    assert lone.logits["M"] == pytest.approx(lone.logits["N"])


def test_no_worker_measured_prices_every_one_with_the_defaults_and_says_so() -> None:
    decision = choose(STICKY, [WorkerLoad("A"), WorkerLoad("B")])
    assert decision.worker == "A"  # device pages cost nothing, whatever the rate
    assert set(decision.fallbacks) == {"prefill=default", "host_load=default",
                                       "l3_read=default"}
    # B reads the prefix: at the default ratios an L3 page costs 0.5 of recomputing it.
    page_s = PAGE * DEFAULT_SECONDS_PER_TOKEN
    assert decision.logits["B"] == pytest.approx(PAGES * 0.5 * page_s
                                                 + 4 * DEFAULT_SECONDS_PER_TOKEN)


def test_the_shared_pools_answer_counts_only_its_run_past_the_host_prefix() -> None:
    # The index knows nothing of L3; the pool holds pages 0-7 and 9-15 (a gap at 8).
    pool = InMemorySharedPool([h for i, h in enumerate(HASHES) if i != 8])
    decision = choose({}, [WorkerLoad("A", costs=costs(read_per_page=0.001))], shared=pool)
    assert decision.shared_outcome == "answered"
    assert decision.shared_hits == PAGES - 1
    assert decision.shared_beyond == 8
    assert decision.terms["cached_tokens"] == 8 * PAGE


def test_no_worker_is_an_error() -> None:
    with pytest.raises(NoWorkerError):
        choose({}, [])


# A holds the prefix on its device and is busy: a prefill queued, two requests decoding.
BUSY_HOME = WorkerLoad("A", queued_prefill_s=0.3, prefilling_requests=1, decoding_requests=2,
                       cache_usage=1.0, costs=costs())


def test_the_cluster_score_keeps_a_turn_home_where_its_own_ttft_would_leave() -> None:
    idle = WorkerLoad("B", cache_usage=1.0, costs=costs())
    own = choose({"A": TierOverlap(gpu=PAGES, host=PAGES)}, [BUSY_HOME, idle])
    # Its own TTFT: 0.3 s of queue and 4 tokens at A against 0.26 s recomputed at B.
    assert own.worker == "B"
    cluster = choose({"A": TierOverlap(gpu=PAGES, host=PAGES)}, [BUSY_HOME, idle],
                     score="cluster")
    assert cluster.worker == "A"
    # A: its TTFT plus its 4 tokens' forward delaying 1 + 2 requests and one evicted page's
    # worth (a full cache); B: the whole prompt's forward, on top of its TTFT, evicts as much.
    assert cluster.logits["A"] == pytest.approx(0.3 + 4 * PER_TOKEN + 4 * PER_TOKEN * 4)
    assert cluster.logits["B"] == pytest.approx(PROMPT * PER_TOKEN * 2)
    # What is reported as predicted is still the request's own TTFT there.
    assert cluster.predicted_ttft_s == pytest.approx(0.3 + 4 * PER_TOKEN)


def test_the_cluster_score_of_an_idle_worker_with_room_is_its_ttft() -> None:
    empty = WorkerLoad("B", cache_usage=0.0, costs=costs())
    decision = choose({}, [empty], score="cluster")
    assert decision.logits["B"] == pytest.approx(decision.predicted_ttft_s)


def test_loads_do_not_count_as_work_the_others_wait_for() -> None:
    # The prefix is read from L3 at B: the reads run beside the forward, only the 4 computed
    # tokens delay B's two decoding requests (its cache not probed yet: taken as full).
    reader = WorkerLoad("B", decoding_requests=2, costs=costs())
    decision = choose({"B": TierOverlap(external=PAGES)}, [reader], score="cluster")
    ttft = decision.predicted_ttft_s
    assert decision.terms["load_s"] == pytest.approx(PAGES * 0.0051)
    assert decision.logits["B"] == pytest.approx(ttft + 4 * PER_TOKEN * 3)


def test_an_unknown_score_is_refused() -> None:
    with pytest.raises(ValueError, match="ttft_score"):
        ScoringConfig(ttft_score="fastest")


def test_a_worker_whose_device_is_full_makes_the_request_wait_for_room() -> None:
    from hicache.router.device_room import InFlight

    # A holds the prefix on its device, but its pool (40 pages) is taken by a request that
    # ends in 2 s: this one (17 pages and one to decode) waits for it. B has room.
    full = WorkerLoad("A", costs=costs(), device_pages=40.0,
                      in_flight=(InFlight(2.0, 30.0),))
    decision = choose(STICKY, [full, WorkerLoad("B", costs=costs(), device_pages=40.0)])
    assert decision.worker == "B"
    assert decision.logits["A"] == pytest.approx(2.0 + 4 * PER_TOKEN)
    assert decision.terms["room_s"] == 0.0
    # The room and the prefill queue pass at once: the longer one counts.
    queued = WorkerLoad("A", costs=costs(), queued_prefill_s=3.0, device_pages=40.0,
                        in_flight=(InFlight(2.0, 30.0),))
    only = choose(STICKY, [queued])
    assert only.terms["room_s"] == pytest.approx(2.0)
    assert only.predicted_ttft_s == pytest.approx(3.0 + 4 * PER_TOKEN)
    # A pool of unknown size: no wait is priced.
    unknown = choose(STICKY, [WorkerLoad("A", costs=costs(), in_flight=(InFlight(2.0, 30.0),))])
    assert unknown.terms["room_s"] == 0.0
