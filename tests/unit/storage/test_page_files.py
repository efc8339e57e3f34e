"""The page-file layout the file and nixl backends share."""

from __future__ import annotations

import os
from pathlib import Path

from hicache.storage.frame import PayloadOrder, object_name
from hicache.storage.page_files import (
    create_file,
    is_page_name,
    is_stale_temp,
    page_path,
    temp_name,
    unlink_quietly,
)

KEY = bytes(range(16))


def test_page_names_are_object_names_and_nothing_else() -> None:
    for order in PayloadOrder:
        assert is_page_name(object_name(KEY, order))
    name = object_name(KEY, PayloadOrder.TOKEN_MAJOR)
    assert not is_page_name(name[:-1] + "x")  # unknown order tag
    assert not is_page_name("g" + name[1:])  # not hex
    assert not is_page_name("0" + name)  # too long
    assert not is_page_name(temp_name(name, os.getpid(), 1))
    assert page_path("/r", name) == f"/r/{name[:2]}/{name}"


def test_files_are_created_with_their_fan_out_directory_and_removed_quietly(
    tmp_path: Path,
) -> None:
    path = page_path(str(tmp_path), object_name(KEY, PayloadOrder.LAYER_MAJOR))
    os.close(create_file(path, 0))
    assert os.path.isfile(path) and os.path.getsize(path) == 0
    unlink_quietly(path)
    assert not os.path.exists(path)
    unlink_quietly(path)  # already gone: nothing raised


def test_a_live_writers_temporary_is_stale_only_when_old() -> None:
    name = temp_name(object_name(KEY, PayloadOrder.LAYER_MAJOR), os.getpid(), 7)
    assert not is_stale_temp(name, age_s=1.0)
    assert is_stale_temp(name, age_s=10**6)
    assert is_stale_temp(".junk.tmp", age_s=1.0)  # not a name we write
