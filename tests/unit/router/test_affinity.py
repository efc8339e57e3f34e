"""Conversation affinity: a turn goes to its last turn's worker when its pages are gone from
every worker, unless that costs it more than a request of its own size."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from hicache.engine.reuse_plan import CostSnapshot
from hicache.estimators import PrefillCoefficients
from hicache.events.messages import MEDIUM_CPU, BlockStored, KVEventBatch
from hicache.router.affinity import ConversationHomes
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.types import RouteDecision, RouteRequest, RoutingPolicy, WorkerLoad

PAGE = 16
# 1 ms a prompt token: a 64-token turn costs 64 ms of prefill.
COSTS = CostSnapshot(prefill=PrefillCoefficients(0.0, 1e-3, 0.0, 0.0), chunk_tokens=None,
                     load_latency_s=0.0, load_seconds_per_page=1e-4, read_latency_s=0.0,
                     read_seconds_per_page=1e-3)


def test_the_deepest_recorded_page_names_the_home() -> None:
    homes = ConversationHomes()
    opening = [1, 2]  # a system prompt two conversations share
    homes.record([*opening, 10, 11], "A")  # conversation one's turn
    homes.record([*opening, 20], "B")  # conversation two's turn
    assert homes.home([*opening, 10, 11, 12, 13]) == "A"  # its next turn extends it
    assert homes.home([*opening, 20, 21]) == "B"
    assert homes.home([*opening, 30]) is None  # a new conversation: the opening is no one's
    assert homes.home([]) is None
    homes.record([*opening, 10, 11, 12, 13], "B")  # the conversation moved
    assert homes.home([*opening, 10, 11, 12, 13, 14]) == "B"


def test_homes_are_bounded_least_recently_used_first() -> None:
    homes = ConversationHomes(max_entries=2)
    homes.record([1], "A")
    homes.record([2], "B")
    assert homes.home([1]) == "A"  # a use keeps page 1
    homes.record([3], "A")
    assert len(homes) == 2
    assert homes.home([2]) is None
    assert homes.home([1]) == "A" and homes.home([3]) == "A"
    with pytest.raises(ValueError, match="max_entries"):
        ConversationHomes(max_entries=0)


def _policy(name: str, affinity: bool = True) -> RoutingPolicy:
    # An empty index: no worker holds any page on device or host (they left long ago).
    return build_policy(name, PageIndex(), None, ScoringConfig(conversation_affinity=affinity))


def _turn(policy: RoutingPolicy, pages: Sequence[int], loads: dict[str, int]) -> RouteDecision:
    """A turn of ``len(pages)`` full pages; ``loads``: each worker's active prompt pages
    (tier_aware's load term) and, for predicted_ttft, its queue as that many ms."""
    workers = [WorkerLoad(url, active_requests=1 if load else 0, decode_blocks=float(load),
                          queued_prefill_s=load * PAGE * 1e-3, costs=COSTS)
               for url, load in loads.items()]
    request = RouteRequest(page_hashes=list(pages), prompt_tokens=len(pages) * PAGE,
                           workers=workers, page_size=PAGE)
    return asyncio.run(policy.choose(request, list(range(len(pages) * PAGE))))


@pytest.mark.parametrize("name", ["tier_aware", "predicted_ttft"])
def test_a_turn_goes_home_unless_home_is_busier_by_more_than_the_turn(name: str) -> None:
    policy = _policy(name)
    first = _turn(policy, [1, 2, 3, 4], {"A": 0, "B": 3})
    assert first.worker == "A" and first.home is None  # new: the less loaded
    # Its next turn (4 + 2 pages): A is now busier than B by 5 pages of load, within
    # the turn's own 6 pages: it stays home.
    second = _turn(policy, [1, 2, 3, 4, 5, 6], {"A": 5, "B": 0})
    assert (second.worker, second.home) == ("A", "A")
    # Busier by more than the turn itself (7 > 6 pages): it leaves, and B is home now.
    third = _turn(policy, [1, 2, 3, 4, 5, 6], {"A": 7, "B": 0})
    assert (third.worker, third.home) == ("B", "A")
    fourth = _turn(policy, [1, 2, 3, 4, 5, 6, 7, 8], {"A": 0, "B": 6})
    assert (fourth.worker, fourth.home) == ("B", "B")


@pytest.mark.parametrize("name", ["tier_aware", "predicted_ttft"])
def test_without_affinity_the_load_decides(name: str) -> None:
    policy = _policy(name, affinity=False)
    assert _turn(policy, [1, 2, 3, 4], {"A": 0, "B": 3}).worker == "A"
    second = _turn(policy, [1, 2, 3, 4, 5, 6], {"A": 5, "B": 0})
    assert (second.worker, second.home) == ("B", None)


def test_a_home_that_is_not_a_candidate_is_no_home() -> None:
    policy = _policy("tier_aware")
    assert _turn(policy, [1, 2], {"A": 0, "B": 1}).worker == "A"
    # A is gone (unhealthy, or it failed this request): B and C score alike.
    decision = _turn(policy, [1, 2, 3], {"B": 0, "C": 0})
    assert decision.home is None
    assert decision.worker == "B"


def test_cached_pages_still_outweigh_the_home() -> None:
    index = PageIndex()
    policy = build_policy("tier_aware", index, None, ScoringConfig(conversation_affinity=True))
    assert _turn(policy, [1, 2, 3, 4], {"A": 0, "B": 1}).worker == "A"
    # B's host holds the conversation's four pages (another route put them there).
    event = BlockStored([1, 2, 3, 4], None, [0] * (4 * PAGE), PAGE, None, MEDIUM_CPU)
    index.apply("B", KVEventBatch(ts=0.0, events=[event]))
    decision = _turn(policy, [1, 2, 3, 4, 5, 6], {"A": 0, "B": 0})
    assert (decision.worker, decision.home) == ("B", "A")
