"""predicted_ttft through the real router app in front of fake workers: it reads their cost
models, records each decision's predicted and (streamed) measured TTFT on /metrics and
/decisions, and its ledger frees every request however it ends."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.router.index import PageIndex
from hicache.router.policy import ScoringConfig, build_policy
from tests.abandoned_clients import held_request, leave
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import RunningRouter, running_router
from tests.waiting import wait_until

IDS = list(range(100, 110))  # two full 4-token pages and a partial one
POLICY = (("policy", "predicted_ttft"),)


def fit(seconds_per_token: float) -> dict[str, Any]:
    """A worker's /get_server_info with a measured cost model."""
    return {"internal_states": [{
        "cost_prefill_coef_step_seconds": 0.0,
        "cost_prefill_coef_seconds_per_token": seconds_per_token,
        "cost_prefill_coef_seconds_per_pair": 0.0,
        "cost_prefill_coef_seconds_per_decode_row": 0.0,
        "cost_l2_load_latency_seconds": 0.0, "cost_l2_load_seconds_per_page": 1e-5}]}


def samples(router: RunningRouter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = router.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def queued(router: RunningRouter) -> list[float]:
    return [value for (name, _), value in samples(router).items()
            if name == "router_worker_queued_prefill_seconds"]


def policy() -> Any:
    return build_policy("predicted_ttft", PageIndex(), None, ScoringConfig())


def test_metrics_and_decisions_carry_predicted_and_measured_ttft() -> None:
    workers = [FakeWorker(extra_info=fit(1e-3)), FakeWorker(extra_info=fit(2e-3))]
    with fake_workers(*workers) as urls, running_router(urls, policy=policy()) as router:
        for k in range(3):
            body: dict[str, Any] = {"input_ids": IDS, "stream": True}
            if k == 1:
                body["rid"] = "turn-7"  # the client's own request id
            response = router.post("/generate", json=body)
            assert response.status_code == 200
        response = router.post("/generate", json={"input_ids": IDS})  # not streamed
        assert response.status_code == 200
        found = samples(router)
        assert found[("router_predicted_ttft_seconds_count", POLICY)] == 4
        # Only the streamed ones are measured: a whole answer's first byte is its last.
        assert found[("router_measured_ttft_seconds_count", POLICY)] == 3
        assert found[("router_ttft_prediction_error_seconds_count", POLICY)] == 3
        assert found[("router_ttft_prediction_ratio_count", POLICY)] == 3
        decisions = router.get("/decisions", params={"limit": 4}).json()["decisions"]
        assert [d["stream"] for d in decisions] == [True, True, True, False]
        # The request id the client gave goes with its decision (the worker got it too).
        assert [d["rid"] for d in decisions] == [None, "turn-7", None, None]
        assert workers[0].requests[-3][1]["rid"] == "turn-7"
        for decision in decisions:
            # The faster worker, priced with its own measured 1 ms a token.
            assert decision["worker"] == urls[0]
            assert decision["predicted_ttft_s"] == pytest.approx(len(IDS) * 1e-3)
            assert decision["terms"]["own_s"] == pytest.approx(len(IDS) * 1e-3)
            # Its own figures but for the L3 read: it reports no L3 (nor does the other).
            assert decision["fallbacks"] == ["l3_read=default"]
        assert all(d["measured_ttft_s"] > 0 for d in decisions[:3])
        assert decisions[3]["measured_ttft_s"] is None
        assert router.get("/decisions", params={"limit": 2000}).status_code == 400
        assert wait_until(lambda: queued(router) == [0.0, 0.0])


def test_the_ledger_holds_a_request_until_its_first_byte_and_frees_a_client_gone() -> None:
    # 10 s a token: a request's predicted prefill (100 s) outlasts the test by far, so the
    # queue gauge shows it until the ledger lets it go.
    worker = FakeWorker(extra_info=fit(10.0), answer_delay_s=30.0)
    with fake_workers(worker) as urls, running_router(urls, policy=policy()) as router:
        # A non-streamed request the worker holds: queued until its client leaves.
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "gone"})
        assert wait_until(lambda: len(worker.requests) == 1)
        assert queued(router)[0] > 50.0  # 100 s predicted, less at most what has passed
        leave(sock)
        assert wait_until(lambda: worker.cancelled == ["gone"])
        assert wait_until(lambda: queued(router) == [0.0])
        assert router.workers()[urls[0]]["active_requests"] == 0
        # A streamed one leaves the queue at its first byte, while its answer still streams
        # (the worker waits 30 s between chunks), and the worker's requests with its end.
        worker.stream_delay_s = 30.0
        with httpx.stream("POST", f"{router.url}/generate", timeout=10,
                          json={"input_ids": IDS, "stream": True}) as response:
            chunks = response.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)
            assert wait_until(lambda: queued(router) == [0.0])
            assert router.workers()[urls[0]]["active_requests"] == 1
        assert wait_until(lambda: router.workers()[urls[0]]["active_requests"] == 0)
        decision = router.get("/decisions", params={"limit": 1}).json()["decisions"][0]
        assert decision["predicted_ttft_s"] == pytest.approx(100.0)
        assert 0 < decision["measured_ttft_s"] < 100.0


def test_a_worker_without_a_cost_model_is_priced_from_the_others() -> None:
    workers = [FakeWorker(), FakeWorker(extra_info=fit(1e-3))]
    with fake_workers(*workers) as urls, running_router(urls, policy=policy()) as router:
        assert router.post("/generate", json={"input_ids": IDS, "stream": True}).status_code \
            == 200
        decision = router.get("/decisions", params={"limit": 1}).json()["decisions"][0]
        # A tie on the median's price: registration order, and the decision says so.
        assert decision["worker"] == urls[0]
        assert "prefill=median" in decision["fallbacks"]


def test_tier_aware_reads_each_workers_cache_usage_and_reports_its_prediction() -> None:
    # A's host pool is full, B's empty: with the derived weight a cold request's pages
    # weigh 1 + 0 + 1 at A and 1 + 0 + 0 at B once the probes have read that (before,
    # both are taken as full, and ties alternate between the two).
    workers = [
        FakeWorker(extra_info=fit(1e-3), metrics_text="hicache_host_pool_usage 1.0\n"),
        FakeWorker(extra_info=fit(1e-3), metrics_text="hicache_host_pool_usage 0.0\n"),
    ]
    tier_aware = build_policy("tier_aware", PageIndex(), None, ScoringConfig(
        overlap_weight=None, load_term="pending_prefill"))
    with fake_workers(*workers) as urls, running_router(urls, policy=tier_aware) as router:
        sent = 0

        def route() -> dict[str, Any]:
            nonlocal sent
            sent += 1
            response = router.post("/generate", json={"input_ids": IDS, "stream": True})
            assert response.status_code == 200
            last: dict[str, Any] = router.get("/decisions", params={"limit": 1}).json()[
                "decisions"][0]
            return last

        # A request a tenth of a second at most, until B's usage has been read.
        assert wait_until(lambda: route()["overlap_weight"] == pytest.approx(1.0), poll_s=0.1)
        for _ in range(3):  # from then on the emptier cache wins every cold request
            decision = route()
            assert decision["worker"] == urls[1]
            assert decision["overlap_weight"] == pytest.approx(1.0)
        assert decision["policy"] == "tier_aware"
        # The prediction from B's measured 1 ms a token, and the measured TTFT beside it.
        assert decision["predicted_ttft_s"] == pytest.approx(len(IDS) * 1e-3)
        assert decision["measured_ttft_s"] > 0
        found = samples(router)
        tier = (("policy", "tier_aware"),)
        assert found[("router_predicted_ttft_seconds_count", tier)] == sent
        assert found[("router_measured_ttft_seconds_count", tier)] == sent


def test_a_full_device_prices_the_wait_for_room() -> None:
    # 16 tokens of device (4 pages): a request of 10 tokens and 8 to generate holds 5 pages
    # while it runs; another needs 3 pages and one to decode into.
    info = {**fit(1e-3), "max_total_num_tokens": 16}
    worker = FakeWorker(extra_info=info, stream_delay_s=1.5)
    body = {"input_ids": IDS, "stream": True, "sampling_params": {"max_new_tokens": 8}}
    with fake_workers(worker) as urls, running_router(urls, policy=policy()) as router:
        # A whole streamed answer first: the router measures the worker's decode (the
        # fake's five 1.5 s gaps from its first byte to its end), within what the test
        # sees of the request, however slow the machine.
        began = time.monotonic()
        assert router.post("/generate", json=body).status_code == 200
        decode_within_s = time.monotonic() - began
        first = router.get("/decisions", params={"limit": 1}).json()["decisions"][0]
        assert first["terms"]["room_s"] == 0.0  # nothing else was there
        with httpx.stream("POST", f"{router.url}/generate", timeout=30, json=body) as held:
            chunks = held.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)  # its first byte: it decodes now, holding its 5 pages
            response = router.post("/generate", json={**body, "stream": False})
            assert response.status_code == 200
            last = router.get("/decisions", params={"limit": 1}).json()["decisions"][0]
        # It waits for the one decoding to end (the measured decode, less what has passed).
        assert 0.0 < last["terms"]["room_s"] < decode_within_s
        assert last["predicted_ttft_s"] == pytest.approx(
            max(last["terms"]["queue_s"], last["terms"]["room_s"]) + last["terms"]["own_s"])
