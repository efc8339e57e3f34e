"""The router's request history (what a joining worker is warmed with) and the warm's
budget read from a worker's /get_server_info."""

from __future__ import annotations

import pytest

from hicache.events.hashing import page_hashes
from hicache.router.history import DEDUP_PAGES, RequestHistory
from hicache.router.warm import DEFAULT_HOST_FRACTION, JoinWarmer, has_l3, host_budget_tokens

PAGE = 4


def record(history: RequestHistory, ids: list[int]) -> None:
    history.record(ids, page_hashes(ids, PAGE))


def test_the_most_recent_prompts_come_first_and_turns_of_one_conversation_count_once() -> None:
    history = RequestHistory()
    first = list(range(100, 100 + 6 * PAGE))
    other = list(range(500, 500 + 5 * PAGE))
    record(history, first)
    record(history, other)
    later_turn = [*first, *range(900, 900 + 2 * PAGE)]  # the same opening pages, longer
    record(history, later_turn)
    assert len(history) == 2 and history.num_tokens == len(later_turn) + len(other)
    assert history.recent(10**6, PAGE, 10) == [later_turn, other]


def test_prompts_that_differ_within_the_first_pages_are_kept_apart() -> None:
    history = RequestHistory()
    base = list(range(1000, 1000 + (DEDUP_PAGES + 2) * PAGE))
    changed = list(base)
    changed[(DEDUP_PAGES - 1) * PAGE] += 1  # differs in the last page of the opening
    record(history, base)
    record(history, changed)
    assert len(history) == 2


def test_the_budget_counts_whole_pages_and_skips_what_does_not_fit() -> None:
    history = RequestHistory()
    small = list(range(10, 10 + 2 * PAGE + 1))  # 2 whole pages and a token
    big = list(range(2000, 2000 + 10 * PAGE))
    newest = list(range(3000, 3000 + 3 * PAGE))
    for ids in (small, big, newest):
        record(history, ids)
    # 6 pages of room: the newest (3), not the big one (10), then the small one (2).
    assert history.recent(6 * PAGE, PAGE, 10) == [newest, small]
    assert history.recent(6 * PAGE, PAGE, 1) == [newest]
    assert history.recent(PAGE - 1, PAGE, 10) == []
    # A prompt longer than the worker's context is cut to it.
    assert history.recent(100 * PAGE, PAGE, 1, max_tokens_each=5) == [newest[:5]]


def test_the_history_is_bounded_in_prompts_and_tokens() -> None:
    history = RequestHistory(max_entries=3, max_tokens=10 * PAGE)
    prompts = [list(range(s, s + 2 * PAGE)) for s in range(0, 5000, 1000)]
    for ids in prompts:
        record(history, ids)
    assert len(history) == 3 and history.recent(10**6, PAGE, 10) == prompts[::-1][:3]
    record(history, list(range(9000, 9000 + 9 * PAGE)))  # 9 pages: only it fits
    assert len(history) == 1 and history.num_tokens == 9 * PAGE
    record(history, list(range(20000, 20000 + 11 * PAGE)))  # over the cap alone: not kept
    assert history.num_tokens == 9 * PAGE


def test_prompts_without_a_whole_page_or_with_ids_no_worker_caches_are_not_kept() -> None:
    history = RequestHistory()
    record(history, [1, 2, 3])
    history.record([2**40, 1, 2, 3], [7])
    assert len(history) == 0
    with pytest.raises(ValueError):
        RequestHistory(max_entries=0)


def test_the_budget_is_the_host_pool_times_the_workers_fraction() -> None:
    info = {"page_size": PAGE, "memory": {"host_pool_pages": 100},
            "hicache_warm_host_fraction": 0.25, "l3": {"attached": True}}
    assert host_budget_tokens(info) == 100 * PAGE // 4
    legacy = {"page_size": PAGE, "internal_states": [{"host_pool_pages": 10.0}]}
    assert host_budget_tokens(legacy) == int(10 * PAGE * DEFAULT_HOST_FRACTION)
    assert host_budget_tokens({"page_size": PAGE}) is None
    assert host_budget_tokens({"page_size": PAGE, "memory": {"host_pool_pages": True}}) is None
    odd = {**info, "hicache_warm_host_fraction": 7}
    assert host_budget_tokens(odd) == int(100 * PAGE * DEFAULT_HOST_FRACTION)
    assert has_l3(info) and not has_l3({"l3": {"attached": False}}) and not has_l3({})


def test_a_worker_without_l3_or_host_pool_is_not_warmed() -> None:
    history = RequestHistory()
    record(history, list(range(100, 100 + 3 * PAGE)))
    warmer = JoinWarmer(history, client=None, timeout_s=1.0)  # type: ignore[arg-type]
    assert warmer.items_for({"page_size": PAGE, "memory": {"host_pool_pages": 8}}) is None
    with_l3 = {"page_size": PAGE, "memory": {"host_pool_pages": 8}, "l3": {"attached": True},
               "context_length": 64}
    assert warmer.items_for(with_l3) == [list(range(100, 100 + 3 * PAGE))]
    assert not JoinWarmer(history, None, 0.0).enabled  # type: ignore[arg-type]
