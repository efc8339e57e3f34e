"""Which worker answered each request of a cluster run, and how often a conversation's
next turn went to the worker that answered the turn before it, for any router in front.

The bench client gives every /generate request an id of its own (``rid``), which a
router passes on to the worker (hicache's router and SGLang's alike); each worker's
access log names the id of every request it answered (``server/access_log.py``). A
conversation's turns are its records in round order: a later turn counts as kept when
both it and the turn before it were answered and each was found in exactly one log.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache.bench.report import RequestRecord

# An access log line of an answered /generate request: its id is the line's last field.
_ANSWERED = re.compile(r" POST /generate 200 .* rid=(\S+)$")


def workers_of(logs: Sequence[Path]) -> dict[str, int]:
    """rid -> the index (in ``logs``' order) of the worker that answered it; a rid in more
    than one log is left out (it cannot be placed). A missing log answers nothing."""
    found: dict[str, int] = {}
    twice: set[str] = set()
    for index, path in enumerate(logs):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            match = _ANSWERED.search(line)
            if match is None:
                continue
            rid = match.group(1)
            if rid in found and found[rid] != index:
                twice.add(rid)
            found[rid] = index
    for rid in twice:
        del found[rid]
    return found


@dataclass(frozen=True)
class Placement:
    """Of a run's later turns whose worker and previous turn's worker are known, how many
    went to the same worker."""

    kept: int = 0
    placed: int = 0

    @property
    def share(self) -> float | None:
        return self.kept / self.placed if self.placed else None

    def __add__(self, other: Placement) -> Placement:
        return Placement(self.kept + other.kept, self.placed + other.placed)


def placement(records: Iterable[RequestRecord], worker_of: Mapping[str, int]) -> Placement:
    """How the run's later turns were placed (``worker_of``: from ``workers_of``)."""
    sessions: dict[int, list[RequestRecord]] = defaultdict(list)
    for record in records:
        sessions[record.session].append(record)
    kept = placed = 0
    for turns in sessions.values():
        turns.sort(key=lambda r: r.round)
        for before, after in itertools.pairwise(turns):
            if after.round != before.round + 1:
                continue
            was = worker_of.get(before.rid or "") if before.ok else None
            now = worker_of.get(after.rid or "") if after.ok else None
            if was is None or now is None:
                continue
            placed += 1
            kept += was == now
    return Placement(kept, placed)
