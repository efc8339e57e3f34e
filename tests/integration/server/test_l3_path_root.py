"""``--l3-path-root``: the admin API puts L3 files only under it; clearing spares others' files.

A real server (tiny engine with L2, uvicorn on a loopback port) with an admin
key and its root in a temporary directory. Attaching the file or nixl backend
at a path that resolves outside the root (an absolute path elsewhere, ``..``,
a symlink inside the root pointing out) is a 403 that names the flag, and
nothing is created there. A relative path is taken under the root, and the
store works there. ``/clear_hicache_storage_backend`` then removes the pages
the server wrote and leaves a file it never wrote that only has a page's name.
A server started without the flag confines to the local cache dir.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.local_cache import local_cache_dir
from hicache.storage.frame import HEADER_BYTES
from tests.server_fixtures import RunningServer, serve_in_thread

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = "/hicache/storage-backend"
TIMEOUT_S = 60.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def server(root: Path) -> Iterator[RunningServer]:
    with serve_in_thread(["--enable-hierarchical-cache"], admin_api_key=KEY,
                         l3_path_root=str(root)) as running:
        yield running


def _attach(server: RunningServer, backend: str, path: str) -> httpx.Response:
    body: dict[str, Any] = {"backend": backend,
                            "extra_config": {"path": path, "prefetch_threshold": 16}}
    return httpx.put(f"{server.url}{ROUTE}", headers=AUTH, json=body, timeout=TIMEOUT_S)


def _page_files(path: Path) -> list[Path]:
    # Page files (``<key>.tm``/``.lm``): not temporaries, nor the directory's ledger.
    return [p for p in path.rglob("*.*m") if p.is_file() and not p.name.startswith(".")]


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_paths_outside_the_root_are_403(server: RunningServer, root: Path, backend: str) -> None:
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (root / "link").symlink_to(elsewhere)
    for path in (str(elsewhere / "l3"), str(root / ".." / "elsewhere" / "l3"),
                 "../elsewhere/l3", str(root / "link" / "l3"), "/etc"):
        refused = _attach(server, backend, path)
        assert refused.status_code == 403, (path, refused.text)
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "--l3-path-root" in error["message"]
        assert error["param"] == "extra_config.path"
    assert list(elsewhere.iterdir()) == []  # nothing was created there
    status = httpx.get(f"{server.url}{ROUTE}", headers=AUTH, timeout=TIMEOUT_S).json()
    assert status["attached"] is False


def test_the_path_of_a_backend_wrapped_by_the_throttled_one_is_confined_too(
    server: RunningServer, root: Path,
) -> None:
    def attach(path: str) -> httpx.Response:
        extra = {"backend": "file", "backend_extra": {"path": path}, "prefetch_threshold": 16}
        return httpx.put(f"{server.url}{ROUTE}", headers=AUTH, timeout=TIMEOUT_S,
                         json={"backend": "throttled", "extra_config": extra})

    elsewhere = root.parent / "elsewhere"
    refused = attach(str(elsewhere / "l3"))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["param"] == "extra_config.backend_extra.path"
    assert not elsewhere.exists()
    attached = attach("stores/throttled")
    assert attached.status_code == 200, attached.text
    assert (root / "stores" / "throttled").is_dir()


def test_a_relative_path_is_under_the_root_and_clear_spares_a_look_alike(
    server: RunningServer, root: Path,
) -> None:
    attached = _attach(server, "file", "stores/a")
    assert attached.status_code == 200, attached.text
    store = root / "stores" / "a"
    info = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT_S).json()
    assert info["l3"]["config"]["path"] == str(store)
    prompt = {"text": "a prompt of a few pages " * 8,
              "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    assert httpx.post(f"{server.url}/generate", json=prompt,
                      timeout=TIMEOUT_S).status_code == 200
    assert server.wait_until(lambda: bool(_page_files(store)))
    ours = _page_files(store)
    look_alike = ours[0].parent / ("f" * 32 + ".tm")  # a page's name, not our bytes
    look_alike.write_bytes(os.urandom(ours[0].stat().st_size - HEADER_BYTES) + b"x" * 48)
    assert server.wait_idle()
    cleared = httpx.post(f"{server.url}/clear_hicache_storage_backend", headers=AUTH,
                         timeout=TIMEOUT_S)
    assert cleared.status_code == 200, cleared.text
    assert _page_files(store) == [look_alike]


def test_without_the_flag_the_root_is_the_local_cache_dir(tmp_path: Path) -> None:
    with serve_in_thread(["--enable-hierarchical-cache"], admin_api_key=KEY) as server:
        assert _attach(server, "file", str(tmp_path / "l3")).status_code == 403
        inside = local_cache_dir() / "l3-admin"
        attached = _attach(server, "file", str(inside))
        assert attached.status_code == 200, attached.text
        assert inside.is_dir()
