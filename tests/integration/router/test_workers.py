"""Workers: discovery from /get_server_info, refusal of a different page size or model,
the admin routes, and health: a dead worker out of routing with its index dropped, a
returning one resynced from its KV events. Real HTTP servers and ZMQ sockets."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from hicache.router.serve import RouterStartupError, discover_workers
from hicache.router.subscriber import EventEndpoints
from hicache.router.workers import WorkerError, parse_server_info, reachable_endpoint
from tests.router_fakes import FakeWorker, Publisher, batch, fake_workers
from tests.router_fixtures import running_router
from tests.waiting import wait_until

# Three failing probes in a row (0.2 s apart, each up to a 0.2 s timeout; one that times out
# on a loaded machine counts as slowness, not as a failure, and is probed again): well past
# that, and still "a few seconds".
DOWN_WITHIN_S = 15.0


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    try:
        yield pub
    finally:
        pub.close()


def test_server_info_is_read_in_sglang_and_hicache_forms() -> None:
    info = parse_server_info("http://10.0.0.5:30000", {
        "page_size": 16, "served_model_name": "m", "model_path": "/p/m",
        "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557",
                                        "replay_endpoint": "tcp://*:5558", "topic": "kv"}),
        "hicache_l3_key_seed": 7,
    })
    assert info.events == EventEndpoints("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")
    assert (info.model, info.model_path, info.l3_key_seed) == ("m", "/p/m", "7")
    info = parse_server_info("http://h:1", {"page_size": 4, "model_path": "/p/m",
                                            "kv_events_endpoint": "tcp://127.0.0.1:9"})
    assert info.model == "/p/m"
    assert info.events == EventEndpoints("tcp://127.0.0.1:9", None, "")
    assert parse_server_info("http://h:1", {"page_size": 4, "model_path": "m"}).events is None
    assert reachable_endpoint("tcp://0.0.0.0:5", "::1") == "tcp://[::1]:5"
    assert reachable_endpoint("ipc:///tmp/x", "h") == "ipc:///tmp/x"
    for bad, what in (({"model_path": "m"}, "page_size"), ({"page_size": 0, "model_path": "m"},
                      "page_size"), ({"page_size": 4}, "names no model")):
        with pytest.raises(WorkerError, match=what):
            parse_server_info("http://h:1", bad)


def test_start_up_refuses_a_worker_of_another_page_size_or_model() -> None:
    a, b, c = FakeWorker(page_size=4), FakeWorker(page_size=8), FakeWorker(model="other")
    with fake_workers(a, b, c) as (url_a, url_b, url_c):
        assert [i.page_size for i in discover_workers([url_a], timeout_s=5)] == [4]
        with pytest.raises(RouterStartupError) as error:
            discover_workers([url_a, url_b], timeout_s=5)
        message = str(error.value)
        assert f"{url_b} has page size 8" in message and f"{url_a} has page size 4" in message
        with pytest.raises(RouterStartupError, match=r"serves model 'other'.*'tiny-model'"):
            discover_workers([url_a, url_c], timeout_s=5)
    with pytest.raises(RouterStartupError, match="does not answer /get_server_info"):
        discover_workers(["http://127.0.0.1:9"], timeout_s=0.3, retry_s=0.1)


def test_admin_adds_lists_and_removes_workers() -> None:
    a, b, odd = FakeWorker(), FakeWorker(), FakeWorker(page_size=16)
    with fake_workers(a, b, odd) as (url_a, url_b, url_odd), running_router([url_a]) as router:
        response = router.post("/workers", json={"url": url_b + "/"})
        assert response.status_code == 201, response.text
        assert list(router.workers()) == [url_a, url_b]
        response = router.post("/workers", json={"url": url_odd})
        assert response.status_code == 409
        message = response.json()["error"]["message"]
        assert f"{url_odd} has page size 16" in message and "page size 4" in message
        assert router.post("/workers", json={"url": url_b}).status_code == 409  # already there
        for body, status in (({"url": "ftp://x"}, 400), ({"url": "http://h:1/v1"}, 400),
                             ({}, 400), ({"url": "http://127.0.0.1:9"}, 502)):
            assert router.post("/workers", json=body).status_code == status, body
        response = httpx_delete(router.url, url_a)
        assert response.status_code == 200
        assert list(router.workers()) == [url_b]
        assert url_a in router.index.removed
        assert httpx_delete(router.url, url_a).status_code == 404
        assert router.post("/generate", json={"input_ids": [1, 2, 3, 4]}).status_code == 200
        assert len(b.requests) == 1 and a.requests == []


def test_with_an_admin_key_changes_need_the_bearer() -> None:
    a = FakeWorker()
    with fake_workers(a) as (url,), running_router(admin_api_key="sesame") as router:
        assert router.post("/workers", json={"url": url}).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert router.post("/workers", json={"url": url}, headers=wrong).status_code == 401
        right = {"authorization": "Bearer sesame"}
        assert router.post("/workers", json={"url": url}, headers=right).status_code == 201
        assert httpx_delete(router.url, url).status_code == 401
        assert httpx_delete(router.url, url, headers=right).status_code == 200


def test_a_dead_worker_is_routed_around_and_resynced_when_back(publisher: Publisher) -> None:
    a, b = FakeWorker(publisher=publisher), FakeWorker()
    with fake_workers(a, b) as (url_a, url_b), running_router([url_a, url_b]) as router:
        publisher.wait_subscribed()
        publisher.publish(batch(1, 2))
        assert wait_until(lambda: router.index.hashes(url_a) == [1, 2])
        assert router.workers()[url_a]["kv_events_last_sequence"] == 0

        a.healthy = False
        assert wait_until(lambda: not router.workers()[url_a]["healthy"], DOWN_WITHIN_S)
        assert url_a in router.index.removed and url_a not in router.index.pages
        assert f'router_worker_up{{worker="{url_a}"}} 0.0' in router.get("/metrics").text
        for _ in range(3):
            assert router.post("/generate", json={"input_ids": [5, 6, 7, 8]}).status_code == 200
        assert a.requests == [] and len(b.requests) == 3

        publisher.publish(batch(3), send=False)  # while it was away
        a.healthy = True
        publisher.wait_subscribed()  # a new subscription when it came back
        assert wait_until(lambda: router.index.hashes(url_a) == [1, 2, 3], DOWN_WITHIN_S)
        assert router.workers()[url_a]["healthy"] is True
        publisher.publish(batch(4))
        assert wait_until(lambda: router.index.hashes(url_a) == [1, 2, 3, 4])
        metrics = router.get("/metrics").text
        # One batch before it went down, two replayed when it came back, one after: the
        # total runs on across the worker's subscribers.
        assert f'router_kv_event_batches_total{{worker="{url_a}"}} 4.0' in metrics
        assert "router_indexed_pages 4.0" in metrics


def httpx_delete(base: str, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.delete(f"{base}/workers", params={"url": url}, headers=headers, timeout=10)
