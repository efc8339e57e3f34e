"""The admin API: PUT/GET/DELETE /hicache/storage-backend with a bearer key, and the
/flush_cache control: keys, attach / re-attach / detach, refusals, 409 while busy, and the
"dynamic" backend (it runs code) only behind --admin-allow-dynamic-backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_fixtures import RunningServer, long_stream, serve_in_thread

KEY = "test-admin-key"
ROUTE = "/hicache/storage-backend"
CLEAR = "/clear_hicache_storage_backend"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The tests' stores live in their tmp_path: under pytest's base temp dir.
    root = str(tmp_path_factory.getbasetemp())
    with serve_in_thread(["--enable-hierarchical-cache"], admin_api_key=KEY,
                         l3_path_root=root) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


def file_backend(path: Path, **fields: Any) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"path": str(path), "prefetch_threshold": 16},
            **fields}


def message(response: httpx.Response) -> str:
    text: str = response.json()["error"]["message"]
    return text


def test_without_a_configured_key_the_admin_api_is_off() -> None:
    with serve_in_thread() as bare, httpx.Client(base_url=bare.url, timeout=30.0) as http:
        for method in ("GET", "PUT", "DELETE"):
            response = http.request(method, ROUTE, headers=AUTH, json={"backend": "file"})
            assert response.status_code == 400
            assert "--admin-api-key" in message(response)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
)
def test_a_missing_or_wrong_key_is_401(client: httpx.Client, headers: dict[str, str]) -> None:
    for method in ("GET", "PUT", "DELETE"):
        response = client.request(method, ROUTE, headers=headers, json={"backend": "file"})
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False  # nothing changed


def test_attach_update_detach(
    client: httpx.Client, server: RunningServer, tmp_path: Path
) -> None:
    assert client.get(ROUTE, headers=AUTH).json() == {"attached": False, "error": None}

    attached = client.put(ROUTE, headers=AUTH, json=file_backend(tmp_path))
    assert attached.status_code == 200, attached.text
    status = attached.json()
    assert status["attached"] is True and status["backend"] == "file"
    assert status["prefetch_policy"] == "timeout" and status["prefetch_threshold"] == 16

    # The same backend again: only the policy changes.
    updated = client.put(
        ROUTE, headers=AUTH, json=file_backend(tmp_path, prefetch_policy="wait_complete")
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["prefetch_policy"] == "wait_complete"
    assert client.get(ROUTE, headers=AUTH).json()["prefetch_policy"] == "wait_complete"
    # The per-1K-token allowance may follow the observed L3 read time: 0.1 s until known.
    auto = file_backend(tmp_path, prefetch_policy="wait_complete")
    auto["extra_config"]["prefetch_timeout_per_ki_token"] = "auto"
    updated = client.put(ROUTE, headers=AUTH, json=auto)
    assert updated.status_code == 200, updated.text
    assert updated.json()["prefetch_timeout_per_ki_token"] == "auto"
    assert updated.json()["prefetch_timeout_per_ki_token_in_force_s"] == 0.1

    # Served requests now back their pages up to the attached directory.
    generated = client.post("/generate", json={
        "input_ids": list(range(1, 50)),
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    })
    assert generated.status_code == 200
    assert server.wait_until(
        lambda: server.engine.storage_status()["metrics"]["backup_pages_stored"] >= 3
    )
    assert any(p.is_file() for p in tmp_path.rglob("*.*m"))  # a page file

    # Another store while one is attached: detach first.
    other = client.put(ROUTE, headers=AUTH, json=file_backend(tmp_path / "other"))
    assert other.status_code == 400 and "detach it first" in message(other)

    detached = client.delete(ROUTE, headers=AUTH)
    assert detached.status_code == 200 and detached.json()["attached"] is False
    again = client.delete(ROUTE, headers=AUTH)  # detaching twice is fine
    assert again.status_code == 200 and again.json()["attached"] is False
    assert client.get("/health").json()["l3"] == {"attached": False, "error": None}
    server.engine.check_integrity()


def _page_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file() and p.suffix in (".lm", ".tm")]


def test_clear_empties_the_store_and_later_turns_recompute(
    client: httpx.Client, server: RunningServer, tmp_path: Path
) -> None:
    assert client.post(CLEAR, headers=AUTH).status_code == 400  # nothing attached
    assert "no L3 storage backend" in message(client.post(CLEAR, headers=AUTH))
    assert client.put(ROUTE, headers=AUTH, json=file_backend(tmp_path)).status_code == 200
    body = {"input_ids": list(range(3, 60)),
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    first = client.post("/generate", json=body).json()
    assert server.wait_until(
        lambda: server.engine.storage_status()["metrics"]["backup_pages_stored"] >= 3
    )
    assert server.wait_idle() and _page_files(tmp_path)
    for method in ("GET", "POST"):
        assert client.request(method, CLEAR).status_code == 401  # the admin key is needed
    assert _page_files(tmp_path)
    cleared = client.post(CLEAR, headers=AUTH)
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["cleared"] is True
    assert not _page_files(tmp_path)
    # L1 and L2 flushed too: the same prompt finds nothing anywhere and is recomputed.
    assert client.post("/flush_cache", headers=AUTH).status_code == 200
    again = client.post("/generate", json=body).json()
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 0
    assert client.get(CLEAR, headers=AUTH).status_code == 200  # an empty store clears too
    assert client.delete(ROUTE, headers=AUTH).status_code == 200
    server.engine.check_integrity()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"backend": "no-such-store"}, "unknown L3 storage backend"),
        ({"backend": "none"}, "DELETE"),
        ({"backend": "file", "prefetch_policy": "sometimes"}, "prefetch-policy"),
        ({"backend": "file", "extra_config": {"prefetch_threshold": "many"}},
         "prefetch_threshold must be an integer"),
        ({"backend": "file", "extra_config": "path=/x"}, "extra_config"),
        ({"backend": "file", "extra_config": {"prefetch_timeout_per_ki_token": "fast"}},
         'prefetch_timeout_per_ki_token must be "auto" or a finite number >= 0'),
        ({"extra_config": {}}, "backend: this field is required"),
    ],
)
def test_bad_attach_is_400(client: httpx.Client, body: dict[str, Any], words: str) -> None:
    response = client.put(ROUTE, headers=AUTH, json=body)
    assert response.status_code == 400, response.text
    assert words in message(response)
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False


def test_busy_server_refuses_l3_changes_and_flush(
    client: httpx.Client, server: RunningServer, tmp_path: Path
) -> None:
    with long_stream(server):
        for response in (
            client.put(ROUTE, headers=AUTH, json=file_backend(tmp_path)),
            client.delete(ROUTE, headers=AUTH),
            client.post("/flush_cache", headers=AUTH),
            client.post(CLEAR, headers=AUTH),
        ):
            assert response.status_code == 409, response.text
            assert "running" in message(response)
        assert client.get(ROUTE, headers=AUTH).status_code == 200  # reading is always fine
    assert server.wait_idle()
    assert client.post("/flush_cache", headers=AUTH).status_code == 200
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False


def test_l3_without_the_host_tier_is_refused(tmp_path: Path) -> None:
    with serve_in_thread(admin_api_key=KEY, l3_path_root=str(tmp_path)) as no_l2, httpx.Client(
        base_url=no_l2.url, timeout=30.0
    ) as http:
        response = http.put(ROUTE, headers=AUTH, json=file_backend(tmp_path))
        assert response.status_code == 400
        assert "host pool" in message(response)


# ------------------------------------------------------------------ the dynamic backend
def code_loading_backend(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A "dynamic" attach body naming a .py file that leaves a marker file when imported
    (the marker says the file's code ran), and the marker's path."""
    marker = tmp_path / "plugin-ran"
    plugin = tmp_path / "plugin_store.py"
    plugin.write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "from tests.unit.storage.test_dynamic_backend import DictStore as Store\n"
    )
    extra = {"module_path": str(plugin), "class_name": "Store", "store": str(tmp_path),
             "prefetch_threshold": 16}
    return {"backend": "dynamic", "extra_config": extra}, marker


@pytest.mark.parametrize("name", ["dynamic", " Dynamic"])
def test_the_dynamic_backend_is_refused_without_the_flag(
    client: httpx.Client, tmp_path: Path, name: str
) -> None:
    body, marker = code_loading_backend(tmp_path)
    response = client.put(ROUTE, headers=AUTH, json={**body, "backend": name})
    assert response.status_code == 403, response.text
    assert "--admin-allow-dynamic-backend" in message(response)
    assert response.json()["error"]["param"] == "backend"
    assert not marker.exists()  # the named file was never imported
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False


def test_the_dynamic_backend_wrapped_by_the_throttled_one_is_refused_too(
    client: httpx.Client, tmp_path: Path
) -> None:
    body, marker = code_loading_backend(tmp_path)
    wrapper = {"backend": "throttled", "extra_config": {
        "backend": " Dynamic", "backend_extra": body["extra_config"], "read_latency_ms": 1}}
    response = client.put(ROUTE, headers=AUTH, json=wrapper)
    assert response.status_code == 403, response.text
    assert "'dynamic' backend" in message(response)
    assert not marker.exists()
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False


def test_with_the_flag_the_dynamic_backend_attaches(tmp_path: Path) -> None:
    body, marker = code_loading_backend(tmp_path)
    with serve_in_thread(
        ["--enable-hierarchical-cache"], admin_api_key=KEY, admin_allow_dynamic_backend=True
    ) as running, httpx.Client(base_url=running.url, timeout=30.0) as http:
        attached = http.put(ROUTE, headers=AUTH, json=body)
        assert attached.status_code == 200, attached.text
        assert attached.json()["backend"] == "dynamic"
        assert marker.read_text() == "imported"
        generated = http.post("/generate", json={
            "input_ids": list(range(1, 50)),
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        })
        assert generated.status_code == 200, generated.text
        assert running.wait_until(
            lambda: running.engine.storage_status()["metrics"]["backup_pages_stored"] >= 3
        )
        assert http.delete(ROUTE, headers=AUTH).json()["attached"] is False


def test_dynamic_chosen_at_start_up_needs_no_flag(tmp_path: Path) -> None:
    body, marker = code_loading_backend(tmp_path)
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config", json.dumps(body["extra_config"])]
    with serve_in_thread(flags, admin_api_key=KEY) as running, httpx.Client(
        base_url=running.url, timeout=30.0
    ) as http:
        assert marker.read_text() == "imported"  # the operator's own choice: loaded
        status = http.get(ROUTE, headers=AUTH).json()
        assert status["attached"] is True and status["backend"] == "dynamic"
        # The admin API still may not name it (not even to re-attach the same one).
        response = http.put(ROUTE, headers=AUTH, json=body)
        assert response.status_code == 403, response.text
        assert http.get(ROUTE, headers=AUTH).json()["backend"] == "dynamic"
