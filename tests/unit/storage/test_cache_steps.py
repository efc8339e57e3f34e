"""Cache-step sizing: reading the last-level cache from sysfs, step size, copy pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.storage.backends.mooncake.cache_steps import (
    FALLBACK_CACHE_BYTES,
    cache_step_bytes,
    copy_pieces,
    last_level_cache_bytes,
    parse_cache_size,
)


def write_cache(root: Path, index: int, level: int, kind: str, size: str) -> None:
    entry = root / f"index{index}"
    entry.mkdir(parents=True)
    (entry / "level").write_text(f"{level}\n")
    (entry / "type").write_text(f"{kind}\n")
    (entry / "size").write_text(f"{size}\n")


def test_cache_sizes_parse_with_and_without_units() -> None:
    assert parse_cache_size("32768K\n") == 32 * 2**20
    assert parse_cache_size("2M") == 2 * 2**20
    assert parse_cache_size("1G") == 2**30
    assert parse_cache_size("512") == 512
    with pytest.raises(ValueError):
        parse_cache_size(" ")


def test_the_highest_level_data_cache_is_the_last_level(tmp_path: Path) -> None:
    write_cache(tmp_path, 0, 1, "Data", "48K")
    write_cache(tmp_path, 1, 1, "Instruction", "32K")
    write_cache(tmp_path, 2, 2, "Unified", "1024K")
    write_cache(tmp_path, 3, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 * 2**20
    # An instruction cache never counts, whatever its level.
    write_cache(tmp_path, 4, 4, "Instruction", "65536K")
    assert last_level_cache_bytes(tmp_path) == 32 * 2**20


def test_an_unreadable_cache_description_falls_back(tmp_path: Path) -> None:
    assert last_level_cache_bytes(tmp_path / "missing") == FALLBACK_CACHE_BYTES
    write_cache(tmp_path, 0, 2, "Unified", "lots")
    assert last_level_cache_bytes(tmp_path) == FALLBACK_CACHE_BYTES


def test_a_step_is_half_the_cache() -> None:
    assert cache_step_bytes(32 * 2**20) == 16 * 2**20
    assert cache_step_bytes(1) == 1


def test_pieces_cover_every_region_in_order_without_gaps() -> None:
    starts, sizes = copy_pieces([1000, 5000], 250, 100)
    assert starts == [1000, 1100, 1200, 5000, 5100, 5200]
    assert sizes == [100, 100, 50, 100, 100, 50]
    # Regions no larger than a piece stay whole.
    assert copy_pieces([7, 70], 32, 32) == ([7, 70], [32, 32])
    with pytest.raises(ValueError):
        copy_pieces([0], 10, 0)
