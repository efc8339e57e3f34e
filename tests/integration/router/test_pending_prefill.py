"""tier_aware with ``--load-term pending_prefill`` through the real router app in front of
fake workers: each worker's ledger holds the pages a request computes there until its first
byte, /metrics shows them, and the next request goes where less prefill is pending."""

from __future__ import annotations

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

IDS = list(range(100, 110))  # two full 4-token pages and a partial one: 2.5 pages of prefill
OTHER = list(range(200, 206))  # 1.5 pages


def pending(router: RunningRouter) -> dict[str, float]:
    text = router.get("/metrics").text
    return {s.labels["worker"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "router_worker_pending_prefill_pages"}


def policy() -> Any:
    return build_policy("tier_aware", PageIndex(), None,
                        ScoringConfig(load_term="pending_prefill"))


def test_pending_pages_steer_the_next_request_and_leave_at_the_first_byte() -> None:
    held = FakeWorker(answer_delay_s=30.0)
    other = FakeWorker()
    with fake_workers(held, other) as urls, running_router(urls, policy=policy()) as router:
        # Held by the first worker: its 2.5 pages are pending there until its client leaves.
        sock = held_request(router.url, "/generate", {"input_ids": IDS, "tag": "gone"})
        assert wait_until(lambda: len(held.requests) == 1)
        assert pending(router) == {urls[0]: pytest.approx(2.5), urls[1]: 0.0}
        # Cold everywhere: 1.5 pages here against 1.5 + 2.5 pending there.
        assert router.post("/generate", json={"input_ids": OTHER}).status_code == 200
        decisions = router.get("/decisions", params={"limit": 2}).json()["decisions"]
        assert [d["worker"] for d in decisions] == urls
        assert [d["prefill_pages"] for d in decisions] == [pytest.approx(2.5),
                                                           pytest.approx(1.5)]
        assert decisions[1]["logits"] == {urls[0]: pytest.approx(4.0),
                                          urls[1]: pytest.approx(1.5)}
        leave(sock)
        assert wait_until(lambda: held.cancelled == ["gone"])
        assert wait_until(lambda: pending(router) == {urls[0]: 0.0, urls[1]: 0.0})
        # A streamed request leaves the pending pages at its first byte, still decoding.
        held.answer_delay_s = 0.0
        held.stream_delay_s = 30.0
        with httpx.stream("POST", f"{router.url}/generate", timeout=10,
                          json={"input_ids": IDS, "stream": True}) as response:
            chunks = response.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)
            assert wait_until(lambda: pending(router) == {urls[0]: 0.0, urls[1]: 0.0})
            assert router.workers()[urls[0]]["active_requests"] == 1
