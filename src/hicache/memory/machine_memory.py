"""How much memory this process may still take, and how much it holds now.

``available_memory()`` is the least of what bounds the next allocation:

- the kernel's ``MemAvailable`` (what can be allocated without swapping: free memory
  plus the page cache and slabs it can reclaim);
- the headroom of every memory cgroup this process is in, its own and each ancestor's
  (a container's limit, a systemd slice's): the limit, less the usage, plus the
  inactive file cache the kernel reclaims before it invokes the OOM killer. cgroup v2
  (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
  ``memory.usage_in_bytes``) are both read; an unlimited cgroup bounds nothing;
- ``HICACHE_AVAILABLE_MEMORY`` (bytes, or with a K/M/G/T suffix) when set: a cap on
  the figure, for running as if on a smaller machine (tests, a share of a big one).

Each bound says where it came from, so a log line can name what limited the pools.
Every figure is None where the system does not say (not Linux): callers then keep
their fixed defaults.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

AVAILABLE_MEMORY_ENV = "HICACHE_AVAILABLE_MEMORY"

# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value.
_UNLIMITED_V1 = 1 << 62
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes this process may still allocate, and the bound that set the figure."""

    bytes: int
    source: str  # "MemAvailable", "cgroup v2 /...", "HICACHE_AVAILABLE_MEMORY"


def available_memory() -> AvailableMemory | None:
    """The tightest of MemAvailable, the cgroup limits and the environment's cap; None
    when none of them is known."""
    bounds: list[AvailableMemory] = []
    meminfo = meminfo_available()
    if meminfo is not None:
        bounds.append(AvailableMemory(meminfo, "MemAvailable"))
    bounds.extend(cgroup_headroom(_read_text("/proc/self/cgroup"),
                                  _read_text("/proc/self/mountinfo")))
    cap = os.environ.get(AVAILABLE_MEMORY_ENV)
    if cap:
        bounds.append(AvailableMemory(parse_bytes(cap, AVAILABLE_MEMORY_ENV),
                                      AVAILABLE_MEMORY_ENV))
    if not bounds:
        return None
    return min(bounds, key=lambda bound: bound.bytes)


def parse_bytes(text: str, name: str) -> int:
    """``12345``, ``512M``, ``3G``, ``1.5G`` (binary units) as bytes; ValueError naming
    ``name`` otherwise."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if found is None:
        raise ValueError(f"{name}={text!r}: give bytes, e.g. 3000000000 or 3G")
    return int(float(found.group(1)) * _SUFFIXES[found.group(2).upper()])


def meminfo_available() -> int | None:
    """The kernel's MemAvailable in bytes; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resident_bytes(pid: int | str = "self") -> int | None:
    """The resident set (VmRSS) of process ``pid`` in bytes; None if unknown."""
    text = _read_text(f"/proc/{pid}/status")
    found = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``), so that a
    measurement of this process counts what it holds, not what a loader freed."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def cgroup_headroom(cgroups: str, mountinfo: str) -> list[AvailableMemory]:
    """The headroom of each limited memory cgroup on the path from this process's cgroup
    to its hierarchy's root, given the texts of /proc/self/cgroup and /proc/self/mountinfo.

    A cgroup's headroom: its limit, less its usage, plus its inactive file cache (which
    the kernel reclaims before it would kill). Unlimited cgroups are left out.
    """
    found: list[AvailableMemory] = []
    for version, mount_root, mount_point, path in _memory_cgroups(cgroups, mountinfo):
        directory = _cgroup_directory(mount_root, mount_point, path)
        while True:
            headroom = _headroom(directory, version)
            if headroom is not None:
                relative = directory.relative_to(mount_point).as_posix()
                relative = "/" if relative == "." else f"/{relative}"
                found.append(AvailableMemory(headroom, f"cgroup {version} {relative}"))
            if directory == mount_point or mount_point not in directory.parents:
                break
            directory = directory.parent
    return found


def _memory_cgroups(cgroups: str, mountinfo: str) -> list[tuple[str, str, Path, str]]:
    """(version, mount root, mount point, this process's cgroup path) of the memory
    controller's hierarchies (v2 and v1 may both be mounted)."""
    paths: dict[str, str] = {}
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths.setdefault("v2", path)
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    out: list[tuple[str, str, Path, str]] = []
    for line in mountinfo.splitlines():
        # ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER_OPTIONS
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, super_options = tail[0], tail[2].split(",")
        if fstype == "cgroup2" and "v2" in paths:
            out.append(("v2", fields[3], Path(fields[4]), paths.pop("v2")))
        elif fstype == "cgroup" and "memory" in super_options and "v1" in paths:
            out.append(("v1", fields[3], Path(fields[4]), paths.pop("v1")))
    return out


def _cgroup_directory(mount_root: str, mount_point: Path, path: str) -> Path:
    """Where the cgroup ``path`` is under a hierarchy mounted from ``mount_root`` (inside
    a container the mount's root is the container's own cgroup)."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    directory = mount_point / path.lstrip("/")
    return directory if directory.is_dir() else mount_point


def _headroom(directory: Path, version: str) -> int | None:
    limit_name, usage_name, cache_key = (
        ("memory.max", "memory.current", "inactive_file") if version == "v2"
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    limit_text = _read_text(str(directory / limit_name)).strip()
    usage_text = _read_text(str(directory / usage_name)).strip()
    if not limit_text.isdigit() or not usage_text.isdigit():
        return None  # "max", absent, unreadable: no limit here
    limit = int(limit_text)
    if limit >= _UNLIMITED_V1:
        return None
    stat = _read_text(str(directory / "memory.stat"))
    cache = re.search(rf"^{cache_key} (\d+)$", stat, re.MULTILINE)
    reclaimable = int(cache.group(1)) if cache else 0
    return max(0, limit - int(usage_text) + reclaimable)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""
