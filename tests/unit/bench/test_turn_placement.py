"""Which worker answered each request (from the workers' access logs, by the id the client
gave it) and the share of later turns kept on the worker of the turn before."""

from __future__ import annotations

from pathlib import Path

from hicache.bench.report import RequestRecord
from hicache.bench.turn_placement import Placement, placement, workers_of

PREFIX = "2026-12-02 18:47:35,028 INFO hicache.access: "


def line(rid: str, status: int = 200, path: str = "/generate") -> str:
    return (f"{PREFIX}POST {path} {status} 3664.7ms prompt=256 cached=0 output=8 "
            f"tenant=default rid={rid}")


def record(session: int, round_: int, rid: str | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(session=session, round=round_, group=0, sent_s=0.0, ok=ok,
                         latency_s=1.0, ttft_s=0.5, ttft_from_content=True, itl_s=[],
                         prompt_tokens=256, output_tokens=8, cached_tokens=0,
                         cached_by_tier=None, rid=rid)


def test_workers_are_read_from_answered_generate_lines(tmp_path: Path) -> None:
    first, second = tmp_path / "worker-0.log", tmp_path / "worker-1.log"
    first.write_text("\n".join([
        line("a1"), line("b2"), line("x9", status=500), line("y7", path="/v1/completions"),
        f"{PREFIX}GET /v1/models 200 4.8ms prompt=0 cached=0 output=0 tenant=- rid=-",
        line("dup"),
    ]) + "\n")
    second.write_text(line("c3") + "\n" + line("dup") + "\n")
    found = workers_of([first, second, tmp_path / "missing.log"])
    # Failed and non-/generate requests place nothing; an id in two logs cannot be placed.
    assert found == {"a1": 0, "b2": 0, "c3": 1}


def test_later_turns_are_kept_when_both_sides_are_placed_on_one_worker() -> None:
    worker_of = {"s0r0": 0, "s0r1": 0, "s0r2": 1, "s1r0": 1, "s1r1": 1, "s2r1": 0}
    records = [
        record(0, 2, "s0r2"), record(0, 0, "s0r0"), record(0, 1, "s0r1"),  # any order
        record(1, 0, "s1r0"), record(1, 1, "s1r1"),
        record(2, 0, "gone"), record(2, 1, "s2r1"),  # its first turn is in no log
        record(3, 0, None), record(3, 1, None),  # no ids (another API)
    ]
    got = placement(records, worker_of)
    assert got == Placement(kept=2, placed=3)  # s0: kept then moved; s1: kept
    assert got.share == 2 / 3


def test_a_failed_turn_or_a_gap_places_nothing() -> None:
    worker_of = {"a": 0, "b": 0, "c": 0}
    records = [record(0, 0, "a"), record(0, 1, "b", ok=False), record(0, 3, "c")]
    assert placement(records, worker_of) == Placement()
    assert Placement().share is None
    assert Placement(1, 2) + Placement(1, 2) == Placement(2, 4)
