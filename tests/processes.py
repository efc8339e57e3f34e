"""Processes seen through Linux /proc: a process's children, and whether one is gone.

Tests use it to find the engine processes ``hicache serve`` spawned and to wait until
they end (a zombie has ended: only its exit status is left for its parent to read).
"""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` started with multiprocessing's spawn (the engine's ranks; not
    its resource tracker)."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process even
    once the pid is reused. None when there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def is_gone(pid: int, started: int | None = None) -> bool:
    """The process has ended: no such pid, a zombie, or (``started`` given) another process
    that has the pid now."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return True
    return started is not None and int(fields[19]) != started


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after its last ')'.
    return stat.rsplit(")", 1)[1].split()
