"""POST /hicache/hints at the router in front of fake workers (``router/hints.py``): pin,
retain and prefetch go to the policy's choice for their prefix, unpin and demote to every
worker the index says holds it (all when none is known to), texts are tokenized by the
router and sent as ids, outcomes come back in order naming their worker (merged when an
item went to several), a refusing worker's items are rejected while the others stand, a
malformed body reaches no worker; and ``hicache_hints`` on a generation body reaches the
worker as sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.events.hashing import page_hashes, tenant_root_digest
from hicache.router.types import RouteDecision, RouteRequest
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.router_fakes import FakeWorker, fake_workers
from tests.router_fixtures import running_router

IDS = list(range(100, 110))  # two full 4-token pages and a partial one
PAGE = 4


class LastPolicy:
    """The last candidate; records what it was asked."""

    name = "last"

    def __init__(self) -> None:
        self.requests: list[tuple[RouteRequest, list[int]]] = []

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        self.requests.append((request, list(token_ids)))
        return RouteDecision(worker=request.workers[-1].url, policy=self.name)


def hint_calls(worker: FakeWorker) -> list[list[dict[str, Any]]]:
    return [body["hints"] for path, body in worker.requests if path == "/hicache/hints"]


def test_pin_retain_and_prefetch_go_where_the_policy_routes_their_prefix() -> None:
    w0, w1 = FakeWorker(), FakeWorker()
    policy = LastPolicy()
    with fake_workers(w0, w1) as urls, running_router(urls, policy=policy) as router:
        response = router.post("/hicache/hints", json={"hints": [
            {"kind": "pin", "input_ids": IDS, "ttl_s": 60, "tier": "l3", "tenant": "acme"},
            {"kind": "retain", "text": "hello there", "cache_salt": "s"},
            {"kind": "prefetch", "input_ids": IDS[:4]},
        ]})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
    text_ids = ByteTokenizer().encode("hello there")
    assert hint_calls(w0) == []
    assert hint_calls(w1) == [[
        {"kind": "pin", "input_ids": IDS, "ttl_s": 60.0, "tier": "l3", "tenant": "acme"},
        {"kind": "retain", "input_ids": text_ids, "tenant": "default", "cache_salt": "s"},
        {"kind": "prefetch", "input_ids": IDS[:4], "tenant": "default"},
    ]]
    # The policy was asked about each prefix's pages, as for a request with that prompt
    # (a salted one in its salt's chain, as the worker's events announce its pages).
    asked = [(list(r.page_hashes), ids) for r, ids in policy.requests]
    salted = page_hashes(text_ids, PAGE, tenant_root_digest("s"))
    assert asked == [(page_hashes(IDS, PAGE), IDS), (salted, text_ids),
                     (page_hashes(IDS[:4], PAGE), IDS[:4])]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert all(r["worker"] == urls[1] and r["outcome"] == "accepted" for r in results)
    assert [r["tokens"] for r in results] == [len(IDS), len(text_ids), 4]


def test_unpin_and_demote_reach_every_holder_or_every_worker_when_none_is_known() -> None:
    w0, w1, w2 = FakeWorker(hint_outcome="rejected"), FakeWorker(), FakeWorker()
    with fake_workers(w0, w1, w2) as urls, running_router(urls) as router:
        router.index.pages[urls[1]] = {"GPU": set(page_hashes(IDS, PAGE))}
        router.index.pages[urls[2]] = {"GPU": set(page_hashes(IDS, PAGE)[:1])}
        unknown = list(range(200, 212))
        response = router.post("/hicache/hints", json={"hints": [
            {"kind": "unpin", "input_ids": IDS},
            {"kind": "demote", "input_ids": unknown},
        ]})
        assert response.status_code == 200, response.text
        unpin, demote = response.json()["results"]
    # The unpin went to the two holders, the demote of an unknown prefix to all three.
    assert [len(hint_calls(w)) for w in (w0, w1, w2)] == [1, 1, 1]
    assert [h["kind"] for h in hint_calls(w0)[0]] == ["demote"]
    assert [h["kind"] for h in hint_calls(w1)[0]] == ["unpin", "demote"]
    assert unpin["outcome"] == "accepted" and unpin["tokens"] == 2 * len(IDS)
    assert sorted(o["worker"] for o in unpin["workers"]) == sorted(urls[1:])
    # The best of the three (w0 rejects): accepted, tokens summed over the workers.
    assert demote["index"] == 1 and demote["outcome"] == "accepted"
    assert demote["tokens"] == 3 * len(unknown)
    assert {o["worker"]: o["outcome"] for o in demote["workers"]} == {
        urls[0]: "rejected", urls[1]: "accepted", urls[2]: "accepted"}


def test_a_refusing_worker_rejects_its_items_and_the_others_stand() -> None:
    w0, w1 = FakeWorker(hint_status=409), FakeWorker()
    with fake_workers(w0, w1) as urls, running_router(urls) as router:
        router.index.pages[urls[0]] = {"GPU": set(page_hashes(IDS, PAGE))}
        router.index.pages[urls[1]] = {"GPU": set(page_hashes(IDS[4:], PAGE))}
        response = router.post("/hicache/hints", json={"hints": [
            {"kind": "pin", "input_ids": IDS},  # FirstPolicy: w0
            {"kind": "demote", "input_ids": IDS[4:]},  # held by w1 only
        ]})
        assert response.status_code == 200, response.text
        pin, demote = response.json()["results"]
        metrics = router.get("/metrics").text
    assert pin["worker"] == urls[0] and pin["outcome"] == "rejected"
    assert "409" in pin["reason"] and "draining" in pin["reason"]
    assert demote["worker"] == urls[1] and demote["outcome"] == "accepted"
    assert 'router_hints_total{kind="pin",outcome="rejected"} 1.0' in metrics
    assert 'router_hints_total{kind="demote",outcome="accepted"} 1.0' in metrics


def test_a_malformed_body_is_a_400_and_no_worker_hears_of_it() -> None:
    worker = FakeWorker(extra_info={"max_req_input_len": 64})
    with fake_workers(worker) as urls, running_router(urls) as router:
        for body, expected in [
            ({"hints": [{"kind": "pin", "input_ids": IDS}, {"kind": "hold", "input_ids": IDS}]},
             "hints[1]: "),
            ({"hints": [{"kind": "pin"}]}, "hints[0]: "),
            ({"hints": []}, "hints is empty"),
            ({"hints": "pin"}, "list of objects"),
            ({"hints": [], "more": 1}, "more"),
            ({"hints": [{"kind": "pin", "input_ids": [1, -2]}]}, "hints[0]: negative"),
            ({"hints": [{"kind": "pin", "input_ids": [1] * 65}]}, "longer than the workers'"),
        ]:
            response = router.post("/hicache/hints", json=body)
            assert response.status_code == 400, response.text
            assert expected in response.json()["error"]["message"]
        assert hint_calls(worker) == []


def test_without_a_healthy_worker_it_is_a_503_after_the_body_is_checked() -> None:
    with running_router([]) as router:
        bad = router.post("/hicache/hints", json={"hints": [{"kind": "pin"}]})
        assert bad.status_code == 400
        good = router.post("/hicache/hints",
                           json={"hints": [{"kind": "pin", "input_ids": IDS}]})
        assert good.status_code == 503


def test_hicache_hints_on_a_generation_body_reach_the_worker() -> None:
    worker = FakeWorker()
    with fake_workers(worker) as urls, running_router(urls) as router:
        for path, prompt in [("/generate", {"input_ids": IDS}),
                             ("/v1/completions", {"prompt": "hello"}),
                             ("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}]})]:
            body = {**prompt, "hicache_hints": [{"kind": "retain", "ttl_s": 30}]}
            response = router.post(path, json=body)
            assert response.status_code == 200, response.text
            assert worker.requests[-1] == (path, body)
