"""tier_aware's load term: Dynamo's in-flight prompt pages, or the pages of prefill still
pending on each worker as the router sent them (``--load-term pending_prefill``)."""

from __future__ import annotations

import argparse

import pytest

from hicache.events.messages import MEDIUM_CPU, BlockStored, KVEventBatch
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig
from hicache.router.settings import add_arguments, settings_from_args
from hicache.router.types import RouteDecision, WorkerLoad
from tests.tier_aware_route import route

PAGE = 16


def _route(index: PageIndex, config: ScoringConfig, pages: list[int],
           workers: list[WorkerLoad]) -> RouteDecision:
    return route(index, config, pages, workers, PAGE)


# A holds two long requests that are decoding (their prefill done: nothing pending);
# B one cold prompt of 8 pages still waiting for its first token.
WORKERS = [
    WorkerLoad("A", active_requests=2, decode_blocks=40.0, pending_prefill_pages=0.0),
    WorkerLoad("B", active_requests=1, decode_blocks=8.0, pending_prefill_pages=8.0),
]


def test_pending_prefill_counts_what_is_left_to_compute_not_what_is_decoding() -> None:
    index = PageIndex()
    dynamo = _route(index, ScoringConfig(), [1, 2, 3, 4], WORKERS)
    assert dynamo.worker == "B"  # 40 prompt pages in flight on A against 8
    pending = _route(index, ScoringConfig(load_term="pending_prefill"), [1, 2, 3, 4], WORKERS)
    assert pending.worker == "A"  # nothing queued ahead of it there
    assert pending.logits == {"A": pytest.approx(4.0), "B": pytest.approx(12.0)}
    assert pending.prefill_pages == pytest.approx(4.0)  # cold everywhere: all 4 pages


def test_the_decision_carries_the_pages_the_chosen_worker_computes() -> None:
    index = PageIndex()
    # B's host holds the first three of the request's four pages.
    event = BlockStored([1, 2, 3], None, [0] * (3 * PAGE), PAGE, None, MEDIUM_CPU)
    index.apply("B", KVEventBatch(ts=0.0, events=[event]))
    idle = [WorkerLoad("A"), WorkerLoad("B")]
    config = ScoringConfig(load_term="pending_prefill", overlap_weight=2.0)
    decision = _route(index, config, [1, 2, 3, 4], idle)
    # A host page saves host_multiplier (0.9) of a page: 4 - 3 * 0.9 pages to compute.
    assert decision.worker == "B"
    assert decision.prefill_pages == pytest.approx(4 - 3 * 0.9)
    assert decision.logits["B"] == pytest.approx(2.0 * (4 - 3 * 0.9))  # the weight applies
    assert decision.logits["A"] == pytest.approx(2.0 * 4)


def test_an_unknown_load_term_is_refused() -> None:
    with pytest.raises(ValueError, match="load_term must be one of"):
        ScoringConfig(load_term="queue")


def test_the_flag_reaches_the_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    url = ["--worker-urls", "http://127.0.0.1:1"]
    default = settings_from_args(parser.parse_args(url))
    assert (default.load_term, default.overlap_weight) == ("pending_prefill", 4.0)
    dynamo = settings_from_args(parser.parse_args([*url, "--load-term", "prompt_pages"]))
    assert dynamo.load_term == "prompt_pages"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-term", "queue"])
