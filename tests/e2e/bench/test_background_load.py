"""``--background-load``: the spinning processes run during the block and are gone after."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hicache.bench.background_load import busy_cores


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


def test_busy_cores_spin_during_the_block_only() -> None:
    assert _spinners() == set()
    with busy_cores(2):
        started = _spinners()
        assert len(started) == 2
        # They burn CPU: their user time grows.
        first = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
                 for pid in started}
        time.sleep(0.5)
        later = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
                 for pid in started}
        assert any(later[pid] > first[pid] for pid in started)
    assert _spinners() == set()
    with busy_cores(0):
        assert _spinners() == set()
