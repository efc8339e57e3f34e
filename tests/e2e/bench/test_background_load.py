"""``--background-load``: the spinning processes run during the block and are gone after."""

from __future__ import annotations

import os
from pathlib import Path

from hicache.bench.background_load import busy_cores
from tests.waiting import wait_until


def _spinners() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and b"while True" in cmdline and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def _user_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])


def test_busy_cores_spin_during_the_block_only() -> None:
    assert _spinners() == set()
    with busy_cores(2):
        started = _spinners()
        assert len(started) == 2
        # They burn CPU: their user time grows.
        first = {pid: _user_ticks(pid) for pid in started}
        assert wait_until(lambda: any(_user_ticks(pid) > first[pid] for pid in started))
    assert _spinners() == set()
    with busy_cores(0):
        assert _spinners() == set()
