"""The persistent request -> page table and the batches the model runner builds from it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicache.engine.engine import Engine
from hicache.engine.page_table import PageTableFullError, ReqToPageTable
from tests.engine_helpers import make_engine_fixture, run, run_many
from tests.integration.engine.test_engine_scheduling import greedy, prompt

__all__ = ["make_engine_fixture"]


def _pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_writes_apply_at_flush_and_only_where_staged() -> None:
    table = ReqToPageTable(num_rows=3, max_pages=4, device="cpu")
    a, b = table.acquire(), table.acquire()
    assert (a, b) == (0, 1)
    table.write(a, 0, _pages(7, 8))
    table.write(b, 0, _pages(3))
    assert table.table.sum() == 0  # staged, not applied
    table.flush()
    table.write(b, 1, _pages(4))
    table.flush()
    assert table.table[a, :2].tolist() == [7, 8]
    assert table.table[b, :2].tolist() == [3, 4]
    assert table.table[2].tolist() == [0, 0, 0, 0]


def test_replace_writes_the_entries_that_changed() -> None:
    table = ReqToPageTable(num_rows=1, max_pages=5, device="cpu")
    row = table.acquire()
    table.write(row, 0, _pages(1, 2, 3))
    table.flush()
    table.table[row, 0] = 99  # an entry replace must not rewrite (it did not change)
    table.replace(row, _pages(1, 2, 3), _pages(1, 5, 3, 6))
    table.flush()
    assert table.table[row].tolist() == [99, 5, 3, 6, 0]


def test_rows_are_reused_and_bounded() -> None:
    table = ReqToPageTable(num_rows=2, max_pages=2, device="cpu")
    first = table.acquire()
    table.acquire()
    with pytest.raises(PageTableFullError, match="rows are in use"):
        table.acquire()
    table.release(first)
    assert table.acquire() == first
    with pytest.raises(PageTableFullError, match="does not fit"):
        table.write(first, 1, _pages(1, 2))


def test_every_step_reads_each_request_s_pages_through_its_row(
    make_engine: Callable[..., Engine],
) -> None:
    """Through prefix hits (rows written at admission), chunked prefills, the tree
    swapping in its own copies of shared pages, retractions and finishes, every step
    the runner builds names for each request the row that holds exactly its pages,
    and its one new token's slot per decode; outputs stay those of requests alone."""
    engine = make_engine("--page-size", "4", "--max-total-tokens", "256",
                         "--chunked-prefill-size", "24")
    runner = engine.scheduler.runner
    build = runner.build_batch
    steps: list[int] = []

    def checked(plan, logits_from=None):  # type: ignore[no-untyped-def]
        batch = build(plan, logits_from)
        batch.validate()  # positions and out_slots end each context, read via the table
        table = runner.table.table
        for i, (req, n) in enumerate(plan):
            assert int(batch.table_rows[i]) == req.row
            assert table[req.row, : len(req.pages)].tolist() == req.pages.tolist()
            assert batch.seq_lens[i] == req.num_computed + n
        steps.append(len(plan))
        return batch

    runner.build_batch = checked  # type: ignore[method-assign]
    swapped: list[int] = []
    replace = runner.table.replace

    def counting_replace(row, old, new):  # type: ignore[no-untyped-def]
        common = min(len(old), len(new))
        swapped.append(int((old[:common] != new[:common]).sum()))
        replace(row, old, new)

    runner.table.replace = counting_replace  # type: ignore[method-assign]
    shared = prompt(7, 30)
    requests = [greedy(shared + prompt(40 + i, 20 + i), n=60) for i in range(4)]
    results = run_many(engine, requests)  # concurrent: the tree dedups their shared pages
    # A prefix hit:
    results.append(run(engine, shared + prompt(90, 10), ignore_eos=True, max_new_tokens=8))
    requests.append(greedy(shared + prompt(90, 10), n=8))
    assert engine.scheduler.counters.num_retractions > 0
    assert sum(r.last.cached_tokens.total for r in results) > 0
    assert max(steps) > 1 and len(steps) > 60
    assert max(swapped) > 0  # the tree did swap its own pages in for a shared prefix
    runner.build_batch = build  # type: ignore[method-assign]
    engine.flush_cache()
    alone = [run(engine, list(r.input_ids), ignore_eos=True,
                 max_new_tokens=r.sampling.max_new_tokens).token_ids for r in requests]
    assert [r.token_ids for r in results] == alone
    assert runner.table.num_free_rows == runner.table.num_rows
    engine.check_integrity()
