"""POST /hicache/drain on a real server (``server/drain.py``): 202 with what it will do and
409 once draining; the contract a router relies on from that moment (/health 503 draining,
/get_server_info draining, new generation requests 503 with Retry-After: 0); every L1 page
L3 lacks written to the file L3 and counted in /metrics; a request still running at the
deadline aborted with a clear error; without L3 the drain just finishes."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from hicache.server.drain import DEADLINE_ERROR
from tests.server_fixtures import RunningServer, serve_in_thread
from tests.waiting import wait_until

KEY = "drain-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PAGE = 16
# write_back: pages stay on the device until evicted, so L3 lacks every one of them.
L3_FLAGS = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
            "--hicache-storage-backend", "file")
PROMPTS = [" ".join(f"word{i}x{j}" for j in range(40)) for i in range(3)]


def l3_flags(path: Path) -> tuple[str, ...]:
    return (*L3_FLAGS, "--hicache-storage-backend-extra-config", json.dumps({"path": str(path)}))


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def generate(client: httpx.Client, text: str, max_new_tokens: int = 4) -> httpx.Response:
    return client.post("/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                          "ignore_eos": True},
    })


def assert_refuses_new_requests(client: httpx.Client) -> None:
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert client.get("/get_server_info").json()["draining"] is True
    bodies = {
        "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"prompt": "hello", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2},
    }
    for route, body in bodies.items():
        response = client.post(route, json=body)
        assert response.status_code == 503, (route, response.text)
        assert response.headers["retry-after"] == "0"
        message = response.json()["error"]["message"]
        assert "draining" in message and "another worker" in message


def test_a_drain_writes_what_l3_lacks_and_then_refuses_new_requests(tmp_path: Path) -> None:
    drained = threading.Event()
    with serve_in_thread(l3_flags(tmp_path / "l3"), admin_api_key=KEY,
                         on_drained=drained.set) as server, \
            httpx.Client(base_url=server.url, timeout=60.0) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/get_server_info").json()["draining"] is False
        assert metric(client, "hicache_drain_state") == 0
        for text in PROMPTS:
            assert generate(client, text).status_code == 200
        assert server.wait_idle()
        assert client.post("/hicache/drain").status_code == 401  # the admin key

        started = client.post("/hicache/drain", headers=AUTH)

        assert started.status_code == 202, started.text
        plan = started.json()
        assert plan["draining"] and plan["l3_attached"] and plan["requests_in_flight"] == 0
        lacking = plan["pages_l3_lacks"]
        assert lacking >= len(PROMPTS) * 40 // PAGE
        assert client.post("/hicache/drain", headers=AUTH).status_code == 409
        assert_refuses_new_requests(client)
        assert drained.wait(60.0), "the drain did not end"
        assert metric(client, "hicache_drain_state") == 3
        assert metric(client, "hicache_drain_pages_to_write") == lacking
        assert metric(client, "hicache_drain_pages_written_total") == lacking
        storage = server.engine.storage_status()
        assert storage["backend_stats"]["pages_written"] == lacking
        assert_refuses_new_requests(client)  # drained: still refusing until it exits


def test_a_request_running_at_the_deadline_is_aborted_with_a_clear_error(
    tmp_path: Path,
) -> None:
    drained = threading.Event()
    with serve_in_thread(l3_flags(tmp_path / "l3"), admin_api_key=KEY, drain_timeout_s=1.0,
                         on_drained=drained.set) as server, \
            httpx.Client(base_url=server.url, timeout=60.0) as client, \
            ThreadPoolExecutor(1) as pool:
        # Far longer than the deadline: it cannot finish by then.
        long: Future[httpx.Response] = pool.submit(
            generate, client, "a long answer", server.engine.max_context_len - 64,
        )
        assert wait_until(lambda: not server.engine.is_idle()), "the request never ran"

        started = client.post("/hicache/drain", headers=AUTH)

        assert started.status_code == 202 and started.json()["requests_in_flight"] == 1
        response = long.result(timeout=60.0)
        assert response.status_code == 500
        assert DEADLINE_ERROR in response.json()["error"]["message"]
        assert drained.wait(60.0), "the drain did not end"
        assert metric(client, "hicache_drain_requests_aborted_total") == 1
        _assert_idle(server)


def test_a_request_running_when_the_drain_starts_finishes(tmp_path: Path) -> None:
    drained = threading.Event()
    with serve_in_thread(l3_flags(tmp_path / "l3"), admin_api_key=KEY,
                         on_drained=drained.set) as server, \
            httpx.Client(base_url=server.url, timeout=60.0) as client, \
            ThreadPoolExecutor(1) as pool:
        running: Future[httpx.Response] = pool.submit(generate, client, PROMPTS[0], 512)
        assert wait_until(lambda: not server.engine.is_idle()), "the request never ran"

        started = client.post("/hicache/drain", headers=AUTH)

        assert started.status_code == 202 and started.json()["requests_in_flight"] == 1
        assert_refuses_new_requests(client)
        response = running.result(timeout=60.0)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 512
        assert drained.wait(60.0), "the drain did not end"
        assert metric(client, "hicache_drain_requests_aborted_total") == 0
        assert metric(client, "hicache_drain_pages_written_total") > 0


def test_without_l3_a_drain_finishes_the_requests_and_ends(tmp_path: Path) -> None:
    drained = threading.Event()
    with serve_in_thread(admin_api_key=KEY, on_drained=drained.set) as server, \
            httpx.Client(base_url=server.url, timeout=60.0) as client:
        assert generate(client, PROMPTS[0]).status_code == 200
        started = client.post("/hicache/drain", headers=AUTH)
        assert started.status_code == 202
        assert started.json()["l3_attached"] is False and started.json()["pages_l3_lacks"] == 0
        assert drained.wait(60.0), "the drain did not end"
        assert metric(client, "hicache_drain_state") == 3
        assert metric(client, "hicache_drain_pages_written_total") == 0
        assert_refuses_new_requests(client)


def _assert_idle(server: RunningServer) -> None:
    assert server.wait_idle()
    server.engine.check_integrity()
