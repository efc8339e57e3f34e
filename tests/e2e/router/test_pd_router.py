"""The --pd-disaggregation router in front of fake prefill and decode instances (real HTTP
on loopback): the pair's bodies, streaming, the cache-aware prefill choice, failures on
either side, clients that leave, and the endpoints that list both pools."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from hicache.events.hashing import page_hashes
from hicache.net import free_port
from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.settings import PrefillEndpoint
from hicache.router.workers import WorkerInfo
from hicache.testing.server_process import ChildServer
from tests.abandoned_clients import held_request, leave
from tests.restartable_server import RestartableServer
from tests.router_fakes import Publisher, batch
from tests.router_fixtures import running_pd_router
from tests.router_pd_fakes import (
    BOOTSTRAP_FIELDS,
    DECODE_CHUNKS,
    FakeInstance,
    Rooms,
    fake_instance_app,
    fake_instances,
)
from tests.waiting import wait_until

IDS = list(range(100, 110))
CLOSED = "http://127.0.0.1:9"  # nothing listens on the discard port


def pair(**decode: object) -> tuple[FakeInstance, FakeInstance]:
    rooms = Rooms()
    return FakeInstance("prefill", rooms), FakeInstance("decode", rooms, **decode)  # type: ignore[arg-type]


def test_both_instances_get_the_body_with_the_bootstrap_fields() -> None:
    prefill, decode = pair()
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p, 9123)], [d],
    ) as router:
        rooms = set()
        for path, body in (("/generate", {"input_ids": IDS, "sampling_params": {"x": "é"}}),
                           ("/v1/completions", {"prompt": IDS, "max_tokens": 2}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            response = router.post(path, json=body)
            assert response.status_code == 200, response.text
            sent = decode.requests[-1]
            assert prefill.requests[-1] == sent and sent[0] == path
            assert response.json() == {"text": "xy", "echo": sent[1]}  # decode's answer
            assert {k: v for k, v in sent[1].items() if k not in BOOTSTRAP_FIELDS} == body
            assert sent[1]["bootstrap_host"] == "127.0.0.1"
            assert sent[1]["bootstrap_port"] == 9123
            room = sent[1]["bootstrap_room"]
            assert isinstance(room, int) and 0 <= room < 2**63
            rooms.add(room)
        assert len(rooms) == 3  # a fresh room per request
        workers = router.get("/workers").json()
        assert [w["active_requests"] for w in workers["prefill"] + workers["decode"]] == [0, 0]


def test_the_router_override_is_not_sent_to_the_instances() -> None:
    prefill, decode = pair()
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        body = {"input_ids": IDS, "router_config_override": {"shared_cache_multiplier": 0.5}}
        assert router.post("/generate", json=body).status_code == 200
        assert "router_config_override" not in decode.requests[-1][1]
        assert decode.requests[-1][1]["bootstrap_port"] == 8998
        assert router.policy.requests[-1].shared_cache_multiplier == 0.5
        assert list(router.policy.requests[-1].page_hashes) == page_hashes(IDS, 4)


def test_a_decode_stream_passes_through_byte_for_byte() -> None:
    prefill, decode = pair()
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router, httpx.Client(timeout=10) as client, client.stream(
        "POST", f"{router.url}/v1/completions", json={"prompt": IDS, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert b"".join(response.iter_raw()) == b"".join(DECODE_CHUNKS)


def test_a_repeated_prefix_goes_to_the_prefill_instance_that_holds_it() -> None:
    rooms = Rooms()
    publishers = [Publisher(), Publisher()]
    first, second = (FakeInstance("prefill", rooms, publisher=pub) for pub in publishers)
    decode = FakeInstance("decode", rooms)
    index = PageIndex()
    policy = build_policy("cache_aware", index, None, ScoringConfig(overlap_weight=4.0))
    other = list(range(500, 516))
    try:
        with fake_instances(first, second, decode) as (p1, p2, d), running_pd_router(
            [PrefillEndpoint(p1), PrefillEndpoint(p2)], [d], policy=policy, index=index,
        ) as router:
            for publisher in publishers:
                publisher.wait_subscribed()
            # The second instance computed `other` earlier (its KV events say so).
            publishers[1].publish(batch(*page_hashes(other, 4)))
            assert wait_until(lambda: index.num_pages() == 4)
            assert router.post("/generate", json={"input_ids": other}).status_code == 200
            assert len(second.requests) == 1 and first.requests == []
            # A new prompt: no overlap anywhere, the first instance by registration order;
            # it then announces the prompt's pages.
            assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
            assert len(first.requests) == 1
            assert wait_until(lambda: index.overlaps(page_hashes(IDS, 4), [p1])[p1].gpu == 2)
            # Each prefix again, longer: back where its pages are.
            assert router.post("/generate", json={"input_ids": [*other, 1, 2, 3, 4]}
                               ).status_code == 200
            assert len(second.requests) == 2 and len(first.requests) == 1
            assert router.post("/generate", json={"input_ids": [*IDS, 7]}).status_code == 200
            assert len(first.requests) == 2
            assert len(decode.requests) == 4
    finally:
        for publisher in publishers:
            publisher.close()


def test_a_prefill_error_drops_the_decode_request_and_is_returned() -> None:
    # The decode instance waits a minute for the KV: only the router's drop ends its wait.
    prefill, decode = pair(kv_wait_s=60.0)
    prefill.fail_status = 503
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        response = router.post("/generate", json={"input_ids": IDS, "tag": "t1"})
        assert response.status_code == 503
        assert response.json() == {"error": {"message": "prefill failed on purpose"}}
        # The decode instance, still waiting for the KV, saw its request dropped.
        assert wait_until(lambda: decode.cancelled == ["t1"])


def test_an_unreachable_prefill_instance_is_taken_out_and_another_pair_serves() -> None:
    # The decode instance waits a minute for the KV: only the router's drop ends its wait.
    prefill, decode = pair(kv_wait_s=60.0)
    dead = WorkerInfo(url=CLOSED, page_size=4, model="tiny-model")
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d], extra_prefill=[dead], health_interval_s=60,
    ) as router:
        response = router.post("/generate", json={"input_ids": IDS, "tag": "t2"})
        assert response.status_code == 200, response.text
        asked = [[w.url for w in r.workers] for r in router.policy.requests]
        assert asked == [[CLOSED, p], [p]]  # FirstPolicy took the dead one first
        assert {w["url"]: w["healthy"] for w in router.get("/workers").json()["prefill"]} == {
            CLOSED: False, p: True}
        # The first decode request (bootstrapped at the dead instance) was dropped: either
        # before it reached the decode instance or, if it did, there.
        assert wait_until(lambda: len(decode.cancelled) == len(decode.requests) - 1)
        assert decode.requests[-1][1]["bootstrap_port"] == 8998
        assert "router_retries_total 1.0" in router.get("/metrics").text


def test_503_when_a_pool_has_no_healthy_instance() -> None:
    """The only decode instance goes down for real (its port refuses connections): the
    router answers 503 naming the empty pool, and routes again once it is back."""
    prefill, decode = pair()
    decode_server = RestartableServer(fake_instance_app(decode))
    with fake_instances(prefill) as (p,), decode_server, running_pd_router(
        [PrefillEndpoint(p)], [decode_server.url],
    ) as router:
        decode_server.stop()
        assert wait_until(lambda: router.get("/health").status_code == 503)
        health = router.get("/health").json()
        assert health["healthy_prefill"] == 1 and health["healthy_decode"] == 0
        response = router.post("/generate", json={"input_ids": IDS})
        assert response.status_code == 503
        assert "no healthy decode instance" in response.json()["error"]["message"]
        decode_server.start()  # back on its address: in rotation once it answers /health
        assert wait_until(lambda: router.get("/health").status_code == 200)
        assert router.post("/generate", json={"input_ids": IDS}).status_code == 200


def test_a_decode_error_drops_the_prefill_request_and_is_returned() -> None:
    prefill, decode = pair(fail_status=500)
    prefill.delay_s = 30.0
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        response = router.post("/generate", json={"input_ids": IDS, "tag": "t3"})
        assert response.status_code == 500
        assert response.json() == {"error": {"message": "decode failed on purpose"}}
        assert wait_until(lambda: prefill.cancelled == ["t3"])
        assert wait_until(lambda: all(
            w["active_requests"] == 0 for pool in router.get("/workers").json().values()
            for w in pool))


def test_an_unreachable_decode_instance_is_a_503_naming_it() -> None:
    prefill, _ = pair()
    dead = WorkerInfo(url=CLOSED, page_size=4, model="tiny-model")
    with fake_instances(prefill) as (p,), running_pd_router(
        [PrefillEndpoint(p)], [], extra_prefill=[], extra_decode=[dead], health_interval_s=60,
    ) as router:
        response = router.post("/generate", json={"input_ids": IDS})
        assert response.status_code == 503
        assert f"{CLOSED} refused the connection" in response.json()["error"]["message"]


def test_a_client_that_leaves_before_any_answer_drops_both_requests() -> None:
    # Both hold the request a minute (prefill computing, decode waiting for the KV): only
    # the client leaving ends them.
    prefill, decode = pair(kv_wait_s=60.0)
    prefill.delay_s = 60.0
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        # The client leaves once both instances hold its request (no client timeout to
        # race the router's forwarding).
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "gone"})
        assert wait_until(lambda: len(prefill.requests) == len(decode.requests) == 1)
        leave(sock)
        assert wait_until(lambda: prefill.cancelled == ["gone"] and decode.cancelled == ["gone"])


def test_a_client_that_leaves_mid_stream_drops_the_decode_request() -> None:
    # 30 s between chunks: the stream is still running whenever the leave reaches decode.
    prefill, decode = pair(delay_s=30.0)
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        with httpx.Client(timeout=10) as client, client.stream(
            "POST", f"{router.url}/generate",
            json={"input_ids": IDS, "stream": True, "tag": "left"},
        ) as response:
            assert next(response.iter_raw()) == DECODE_CHUNKS[0]
        assert wait_until(lambda: decode.cancelled == ["left"])
        assert wait_until(lambda: all(
            w["active_requests"] == 0 for pool in router.get("/workers").json().values()
            for w in pool))


def test_models_flush_health_and_server_info_cover_both_pools() -> None:
    prefill, decode = pair()
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p, 9000)], [d],
    ) as router:
        assert router.get("/v1/models").json()["data"][0]["mode"] == "decode"
        response = router.post("/flush_cache")
        assert response.status_code == 200 and set(response.json()["workers"]) == {p, d}
        assert prefill.flushed == decode.flushed == 1
        aborted = router.post("/abort_request", json={"abort_all": True})
        assert aborted.status_code == 200 and set(aborted.json()["workers"]) == {p, d}
        assert prefill.aborts == decode.aborts == [{"abort_all": True}]
        text = router.post("/detokenize", json={"tokens": [104, 105]}).json()
        assert text == {"text": "hi", "mode": "decode"}
        assert router.get("/health").json() == {
            "status": "ok", "healthy_prefill": 1, "prefill": 1, "healthy_decode": 1,
            "decode": 1}
        info = router.get("/get_server_info").json()
        assert info["pd_disaggregation"] is True and info["page_size"] == 4
        assert [(w["url"], w["bootstrap_port"]) for w in info["prefill"]] == [(p, 9000)]
        assert [w["url"] for w in info["decode"]] == [d]
        assert info["settings"]["prefill"] == [{"url": p, "bootstrap_port": 9000}]
        metrics = router.get("/metrics").text
        for url in (p, d):
            assert f'router_worker_up{{worker="{url}"}} 1.0' in metrics


def test_the_hicache_router_command_serves_a_pair(tmp_path: Path) -> None:
    prefill, decode = pair()
    with fake_instances(prefill, decode) as (p, d):
        port = free_port()
        command = [sys.executable, "-m", "hicache", "router", "--port", str(port),
                   "--pd-disaggregation", "--prefill", p, "9100", "--decode", d,
                   "--policy", "cache_aware", "--worker-startup-timeout", "10"]
        router = ChildServer(command, port, tmp_path / "router.log", startup_timeout_s=30,
                             stop_timeout_s=10, ready_paths=("/health",), name="the router")
        try:
            router.start()
            response = httpx.post(f"{router.url}/generate", json={"input_ids": IDS},
                                  timeout=10)
            assert response.status_code == 200, response.text
            assert prefill.requests[-1][1]["bootstrap_port"] == 9100
            assert response.json()["echo"] == decode.requests[-1][1]
        finally:
            router.stop()
