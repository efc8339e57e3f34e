"""The redis backend through a running server's admin API: attach by name, serve from it,
refuse an unreachable url, detach; the url's password never shows in /get_server_info."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hicache.net import free_port
from hicache.testing.redis_server import RedisServerProcess
from tests.redis_fixtures import extra_fixture, server_fixture  # noqa: F401 - fixtures
from tests.server_fixtures import RunningServer, serve_in_thread
from tests.waiting import wait_until

KEY = "test-admin-key"
ROUTE = "/hicache/storage-backend"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(["--enable-hierarchical-cache"], admin_api_key=KEY) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http
        http.delete(ROUTE, headers=AUTH)


def test_attach_serve_and_detach_through_the_admin_api(
    client: httpx.Client, server: RunningServer, redis_extra: dict[str, Any],
    redis_server: RedisServerProcess,
) -> None:
    body = {"backend": "redis", "extra_config": {**redis_extra, "prefetch_threshold": 16}}
    attached = client.put(ROUTE, headers=AUTH, json=body)
    assert attached.status_code == 200, attached.text
    assert attached.json()["backend"] == "redis"

    prompt = {"text": "hello " * 40, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = client.post("/generate", json=prompt)
    assert first.status_code == 200, first.text
    # The backup is queued once the pages' device->host copy lands, after the answer
    # may have gone out: wait for it to reach the store.
    stats: dict[str, Any] = {}  # wait_until asks at least once

    def written() -> bool:
        nonlocal stats
        stats = client.get(ROUTE, headers=AUTH).json()["backend_stats"]
        return bool(stats["pages_written"])

    wait_until(written, 20.0, poll_s=0.05)  # the assert below says what did not happen
    assert stats["pages_written"] > 0 and stats["failures"] == {}

    detached = client.delete(ROUTE, headers=AUTH)
    assert detached.status_code == 200 and detached.json()["attached"] is False


def test_an_unreachable_url_is_refused_and_its_password_not_shown(
    client: httpx.Client,
) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    body = {"backend": "redis", "extra_config": {"url": url}}
    response = client.put(ROUTE, headers=AUTH, json=body)
    assert response.status_code == 400, response.text
    assert "cannot be reached" in response.text and "s3cret" not in response.text
    assert client.get(ROUTE, headers=AUTH).json()["attached"] is False
    assert "s3cret" not in client.get("/get_server_info").text
