"""The router in front of real (fake) HTTP workers: what it forwards, how it streams,
retries and refuses, and which pages it asks the policy about."""

from __future__ import annotations

import json

import httpx

from hicache.events.hashing import page_hashes
from hicache.router.workers import WorkerInfo
from hicache.server.chat_prompt import chat_prompt_ids
from hicache.server.chat_protocol import ChatCompletionRequest
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.abandoned_clients import held_request, leave
from tests.router_fakes import (
    STREAM_CHUNKS,
    FakeWorker,
    RoundRobinPolicy,
    dropping_server,
    fake_workers,
)
from tests.router_fixtures import running_router
from tests.waiting import wait_until

IDS = list(range(100, 110))  # two full 4-token pages and a partial one


def test_a_request_is_forwarded_as_sent_and_routed_by_its_pages() -> None:
    worker = FakeWorker()
    with fake_workers(worker) as urls, running_router(urls) as router:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 3}, "rid": "é"}
        raw = json.dumps(body).encode()
        response = router.post("/generate", content=raw,
                               headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        assert response.json() == {"path": "/generate", "echo": body}
        request = router.policy.requests[-1]
        assert list(request.page_hashes) == page_hashes(IDS, 4)
        assert request.prompt_tokens == len(IDS)
        assert [w.url for w in request.workers] == urls
        assert request.shared_cache_multiplier is None


def test_the_router_override_is_taken_out_and_handed_to_the_policy() -> None:
    worker = FakeWorker()
    with fake_workers(worker) as urls, running_router(urls) as router:
        body = {"prompt": IDS, "max_tokens": 2,
                "router_config_override": {"shared_cache_multiplier": 0.5}}
        assert router.post("/v1/completions", json=body).status_code == 200
        assert worker.requests[-1] == ("/v1/completions", {"prompt": IDS, "max_tokens": 2})
        assert router.policy.requests[-1].shared_cache_multiplier == 0.5
        for bad, what in (({"shared_cache_multiplier": -1}, ">= 0"),
                          ({"shared_cache_multiplier": "x"}, "a number"),
                          ({"temperature": 1}, "unrecognized field 'temperature'"),
                          ([], "must be an object")):
            response = router.post("/v1/completions",
                                   json={"prompt": IDS, "router_config_override": bad})
            assert response.status_code == 400
            assert what in response.json()["error"]["message"]
        assert len(worker.requests) == 1


def test_malformed_json_is_a_400_and_no_worker_hears_of_it() -> None:
    worker = FakeWorker()
    with fake_workers(worker) as urls, running_router(urls) as router:
        for raw, what in ((b"{nope", "not valid JSON"), (b"[1, 2]", "JSON object"),
                          (b"", "empty"), (b"\xff\xfe", "not valid JSON")):
            response = router.post("/v1/chat/completions", content=raw)
            assert response.status_code == 400
            assert what in response.json()["error"]["message"]
        assert worker.requests == []


def test_text_prompts_are_tokenized_as_the_worker_does() -> None:
    # The fake workers name no tokenizer dir: both sides use the byte-level tokenizer.
    tokenizer = ByteTokenizer()
    with fake_workers(FakeWorker()) as urls, running_router(urls) as router:
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "what is a KV cache, in a sentence?"}]
        assert router.post("/v1/chat/completions",
                           json={"model": "tiny-model", "messages": messages}).status_code == 200
        expected = chat_prompt_ids(tokenizer, ChatCompletionRequest(messages=messages))
        assert list(router.policy.requests[-1].page_hashes) == page_hashes(expected, 4)
        assert router.policy.requests[-1].prompt_tokens == len(expected)

        assert router.post("/v1/completions", json={"prompt": "a prompt text"}).status_code == 200
        assert router.policy.requests[-1].prompt_tokens == len(tokenizer.encode("a prompt text"))

        batch = {"text": ["first prompt here", "second"]}
        assert router.post("/generate", json=batch).status_code == 200
        expected = tokenizer.encode("first prompt here")
        assert list(router.policy.requests[-1].page_hashes) == page_hashes(expected, 4)

        # A body the worker will refuse routes by load alone; the worker answers it.
        odd = {"messages": "not a list"}
        assert router.post("/v1/chat/completions", json=odd).status_code == 200
        assert router.policy.requests[-1].page_hashes == []


def test_a_stream_passes_through_byte_for_byte() -> None:
    with fake_workers(FakeWorker()) as urls, running_router(urls) as router:
        body = {"input_ids": IDS, "stream": True}
        with httpx.Client(timeout=10) as client:
            direct = client.post(f"{urls[0]}/generate", json=body)
            with client.stream("POST", f"{router.url}/generate", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                routed = b"".join(response.iter_raw())
        assert routed == direct.content == b"".join(STREAM_CHUNKS)


def test_a_client_that_leaves_cancels_the_worker_request() -> None:
    # 30 s between chunks: the stream is still running whenever the leave reaches the worker.
    worker = FakeWorker(stream_delay_s=30.0)
    with fake_workers(worker) as urls, running_router(urls) as router:
        with httpx.Client(timeout=10) as client, client.stream(
            "POST", f"{router.url}/generate", json={"input_ids": IDS, "stream": True,
                                                    "tag": "left"},
        ) as response:
            first = next(response.iter_raw())
            assert first == STREAM_CHUNKS[0]
        # Leaving the block closed the connection mid-stream.
        assert wait_until(lambda: worker.cancelled == ["left"])
        assert wait_until(lambda: router.workers()[urls[0]]["active_requests"] == 0)


def test_a_client_that_leaves_before_a_whole_answer_cancels_the_worker_request() -> None:
    worker = FakeWorker(answer_delay_s=30.0)
    with fake_workers(worker) as urls, running_router(urls) as router:
        # The client leaves once the worker holds its request (no client timeout to race
        # the router's forwarding).
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "gone"})
        assert wait_until(lambda: len(worker.requests) == 1)
        leave(sock)
        assert wait_until(lambda: worker.cancelled == ["gone"])
        assert wait_until(lambda: router.workers()[urls[0]]["active_requests"] == 0)


def test_a_worker_failing_before_answering_is_retried_elsewhere() -> None:
    good = FakeWorker()
    with fake_workers(good) as urls, dropping_server() as dropping:
        first = WorkerInfo(url=dropping, page_size=4, model="tiny-model")
        with running_router(urls, extra_workers=[first], health_interval_s=60) as router:
            response = router.post("/generate", json={"input_ids": IDS})
            assert response.status_code == 200
            assert good.requests == [("/generate", {"input_ids": IDS})]
            # FirstPolicy chose the dropping worker, then the only one left.
            asked = [[w.url for w in r.workers] for r in router.policy.requests]
            assert asked == [[dropping, urls[0]], [urls[0]]]
            assert "router_retries_total 1.0" in router.get("/metrics").text
            # A dropped connection is not a refused one: health probes decide about it.
            assert router.workers()[dropping]["healthy"] is True


def test_a_refused_connection_takes_the_worker_out_and_the_next_one_answers() -> None:
    good = FakeWorker()
    closed = WorkerInfo(url="http://127.0.0.1:9", page_size=4, model="tiny-model")
    with fake_workers(good) as urls, running_router(
        urls, extra_workers=[closed], health_interval_s=60,
    ) as router:
        assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
        assert len(good.requests) == 1
        assert router.workers()[closed.url]["healthy"] is False
        assert closed.url in router.index.removed
        assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
        assert [[w.url for w in r.workers] for r in router.policy.requests][-1] == urls


def test_503_with_a_reason_when_no_worker_can_answer() -> None:
    with running_router() as router:
        response = router.post("/generate", json={"input_ids": IDS})
        assert response.status_code == 503
        assert "POST /workers" in response.json()["error"]["message"]
        assert router.get("/health").status_code == 503
    dead = WorkerInfo(url="http://127.0.0.1:9", page_size=4, model="tiny-model")
    with running_router(extra_workers=[dead], health_interval_s=60) as router:
        response = router.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 503
        assert "http://127.0.0.1:9 failed before answering" in response.json()["error"]["message"]
        # The refused connection took it out of routing at once.
        assert router.workers()[dead.url]["healthy"] is False
        response = router.post("/generate", json={"input_ids": IDS})
        assert "all 1 registered workers are down" in response.json()["error"]["message"]


def test_round_robin_spreads_and_metrics_count_each_worker() -> None:
    a, b = FakeWorker(), FakeWorker()
    with fake_workers(a, b) as urls, running_router(urls, policy=RoundRobinPolicy()) as router:
        for _ in range(4):
            assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
        assert len(a.requests) == len(b.requests) == 2
        metrics = router.get("/metrics").text
        for url in urls:
            assert f'router_requests_total{{worker="{url}"}} 2.0' in metrics
            assert f'router_worker_up{{worker="{url}"}} 1.0' in metrics
        assert "router_decision_latency_seconds_count 4.0" in metrics


def test_metrics_record_overlap_and_the_shared_pool() -> None:
    with fake_workers(FakeWorker()) as urls, running_router(urls) as router:
        # FirstPolicy reports every page as a shared hit, one beyond the device prefix.
        router.index.pages[urls[0]] = {"GPU": set(page_hashes(IDS, 4)[:1])}
        assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
        metrics = router.get("/metrics").text
        assert "router_shared_cache_hit_rate_count 1.0" in metrics
        assert "router_shared_cache_hit_rate_sum 1.0" in metrics
        assert "router_shared_cache_beyond_blocks_sum 1.0" in metrics
        assert 'router_overlap_pages_sum{tier="GPU"} 1.0' in metrics


def test_tokenize_goes_to_a_worker_and_abort_to_every_worker() -> None:
    a, b = FakeWorker(), FakeWorker()
    with fake_workers(a, b) as urls, running_router(urls) as router:
        response = router.post("/v1/tokenize", json={"prompt": "hi"})
        assert response.status_code == 200, response.text
        assert response.json() == {"tokens": [104, 105], "count": 2, "max_model_len": 64}
        assert len(a.requests) + len(b.requests) == 1  # one worker answered
        aborted = router.post("/abort_request", json={"rid": "r-7"})
        assert aborted.status_code == 200 and aborted.json()["sent"] is True
        assert set(aborted.json()["workers"]) == set(urls)
        assert a.aborts == b.aborts == [{"rid": "r-7"}]


def test_models_flush_health_and_server_info() -> None:
    a, b = FakeWorker(), FakeWorker()
    with fake_workers(a, b) as urls, running_router(urls) as router:
        assert router.get("/v1/models").json()["data"][0]["id"] == "tiny-model"
        response = router.post("/flush_cache")
        assert response.status_code == 200 and response.json()["flushed"] is True
        assert a.flushed == b.flushed == 1
        assert router.get("/health").json()["healthy_workers"] == 2
        info = router.get("/get_server_info").json()
        assert info["page_size"] == 4 and info["served_model_name"] == "tiny-model"
        assert [w["url"] for w in info["workers"]] == urls
        assert info["settings"]["admin_api_key"] is False
