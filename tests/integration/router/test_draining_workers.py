"""The router and a draining worker: out of routing at once, no failure, no client error.

Stand-in workers on loopback speak the drain contract: while draining, /health answers
503 ``{"status": "draining"}`` and /generate a 503 saying so with ``Retry-After: 0`` (or
only one of the two), and requests already running finish. The registry's tests probe
by hand (one call, one probe); the routers' either never probe on their own (a 60 s
interval: only the proxied refusal can tell them) or probe every 0.2 s."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response, StreamingResponse

from hicache.router.settings import PrefillEndpoint
from hicache.router.workers import WorkerInfo, WorkerRegistry, fetch_worker_info_sync
from tests.abandoned_clients import sample, scrape
from tests.restartable_server import RestartableServer
from tests.router_fakes import DictIndex
from tests.router_fixtures import running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances
from tests.server_fixtures import serve_app_in_thread
from tests.waiting import wait_until

IDS = list(range(100, 110))
DRAINING_MESSAGE = "this worker is draining: retry the request on another worker"


@dataclass
class Drainable:
    """A stand-in worker's drain state and what it was sent."""

    name: str
    draining: bool = False
    # How a draining worker refuses: the header, the body's message, or both.
    refuse_with_header: bool = True
    refuse_with_body: bool = True
    served: int = 0  # generation requests answered 200
    refused: int = 0  # generation requests refused as draining
    aborts: int = 0
    # /health still 200 while draining (asked the moment before the drain began).
    health_lags: bool = False
    hold: threading.Event | None = None  # when set: /generate waits for it to be set
    holding: threading.Event = field(default_factory=threading.Event)


def drainable_app(worker: Drainable) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        if worker.draining and not worker.health_lags:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({}, status_code=200)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, object]:
        return {"page_size": 4, "served_model_name": "tiny-model",
                "draining": worker.draining}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        if worker.draining:
            worker.refused += 1
            message = DRAINING_MESSAGE if worker.refuse_with_body else "unavailable"
            headers = {"Retry-After": "0"} if worker.refuse_with_header else None
            return JSONResponse({"error": {"message": message, "type": "server_error",
                                           "code": 503}}, status_code=503, headers=headers)
        if worker.hold is not None:
            worker.holding.set()
            await asyncio.to_thread(worker.hold.wait, 60)
        worker.served += 1
        if body.get("stream"):
            async def events() -> AsyncIterator[str]:
                for piece in ("a", "b", "c"):
                    yield f"data: {{\"text\": \"{piece}\", \"worker\": \"{worker.name}\"}}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"text": "ok", "worker": worker.name})

    @app.post("/abort_request")
    async def abort() -> dict[str, object]:
        worker.aborts += 1
        return {"aborted": True}

    return app


@contextmanager
def drainables(*workers: Drainable) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_app_in_thread(drainable_app(w))) for w in workers]


def registry_scenario(
    url: str, scenario: Callable[[WorkerRegistry, DictIndex], Awaitable[None]],
    *, register: bool = True,
) -> None:
    """``scenario`` on a registry probed by hand, with ``url`` registered as a plain
    worker unless ``register`` is False."""
    async def run() -> None:
        async with httpx.AsyncClient() as client:
            index = DictIndex()
            registry = WorkerRegistry(index, client, health_interval_s=5.0)
            if register:
                registry.add(WorkerInfo(url=url, page_size=4, model="tiny-model"))
            try:
                await scenario(registry, index)
            finally:
                await registry.stop()

    asyncio.run(run())


def test_a_draining_probe_takes_the_worker_out_as_draining_not_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = Drainable("a")
    with drainables(worker) as (url,):
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            await registry.probe_all()
            state = registry.get(url)
            assert state is not None and state.state == "up"
            worker.draining = True
            for _ in range(5):  # probed again and again: no streak, logged once
                await registry.probe_all()
                assert state.state == "draining" and not state.healthy
                assert state.health.failures == 0
            assert registry.healthy() == [] and registry.reachable() == [state]
            assert index.removed == []  # its entries (and what it drains to L3) kept
            worker.draining = False  # restarted at the same URL: answers 200 again
            await registry.probe_all()
            assert state.state == "up" and state.healthy
            assert index.removed == [url]  # resynced as a new process

        with caplog.at_level(logging.INFO, logger="hicache.router.workers"):
            registry_scenario(url, scenario)
    drained = [r for r in caplog.records if "is draining" in r.getMessage()]
    assert len(drained) == 1
    assert not any("is down" in r.getMessage() for r in caplog.records)


def test_a_worker_discovered_while_draining_is_registered_as_draining() -> None:
    """Its /get_server_info says draining: known, not routed to. A /health 200 with
    /get_server_info still draining does not bring it back either."""
    worker = Drainable("a", draining=True, health_lags=True)
    with drainables(worker) as (url,):
        info = fetch_worker_info_sync(url)

        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            state = registry.add(info)
            assert state.state == "draining" and registry.healthy() == []
            await registry.probe_all()  # /health 200, but still draining
            assert state.state == "draining"
            worker.draining = False
            await registry.probe_all()
            assert state.state == "up"

        registry_scenario(url, scenario, register=False)


def test_a_draining_worker_that_exits_is_down_and_back_when_it_answers() -> None:
    worker = Drainable("a", draining=True)
    server = RestartableServer(drainable_app(worker))
    with server:
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            await registry.probe_all()
            state = registry.get(server.url)
            assert state is not None and state.state == "draining"
            server.stop()  # the drain is over: it exited
            await registry.probe_all()
            assert state.state == "down" and not state.draining
            worker.draining = False
            server.start()
            await registry.probe_all()
            assert state.state == "up"

        registry_scenario(server.url, scenario)


@pytest.mark.parametrize(("header", "body"), [(True, True), (True, False), (False, True)],
                         ids=["header-and-body", "header-only", "body-only"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_refusal_as_draining_is_retried_elsewhere_and_takes_the_worker_out(
    header: bool, body: bool, stream: bool,
) -> None:
    """No probe runs (60 s): the refusal alone takes the worker out. The first policy
    always picks the first candidate, the draining worker while it is routed to."""
    first = Drainable("a", refuse_with_header=header, refuse_with_body=body)
    second = Drainable("b")
    with drainables(first, second) as urls, \
            running_router(urls, health_interval_s=60) as router:
        first.draining = True
        for _ in range(5):
            response = router.post("/generate", json={"input_ids": IDS, "stream": stream})
            assert response.status_code == 200, response.text
            if stream:
                assert '"worker": "b"' in response.text
                assert response.text.endswith("data: [DONE]\n\n")
            else:
                assert response.json()["worker"] == "b"
        assert first.refused == 1  # nothing more after its first refusal
        assert first.served == 0 and second.served == 5
        listed = router.workers()
        assert listed[urls[0]]["state"] == "draining" and listed[urls[0]]["draining"]
        assert listed[urls[1]]["state"] == "up"
        samples = scrape(router.url)
        assert sample(samples, "router_worker_draining", worker=urls[0]) == 1
        assert sample(samples, "router_worker_up", worker=urls[0]) == 0
        assert sample(samples, "router_drain_refusals_total", worker=urls[0]) == 1
        assert samples["router_retries_total"] == 1
        assert sample(samples, "router_worker_failures_total", worker=urls[0],
                      stage="before_answer") == 0
        assert router.get("/health").json()["draining_workers"] == 1


def test_another_503_reaches_the_client_whole_and_the_worker_stays_routed() -> None:
    """A 503 that is not a draining refusal (no Retry-After: 0, no "draining") is the
    worker's answer: passed on as it is, the worker kept in routing (one failure)."""
    first = Drainable("a", refuse_with_header=False, refuse_with_body=False)
    with drainables(first, Drainable("b")) as urls, \
            running_router(urls, health_interval_s=60) as router:
        first.draining = True  # answers a plain 503 "unavailable"
        response = router.post("/generate", json={"input_ids": IDS})
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "unavailable"
        assert router.workers()[urls[0]]["state"] == "up"
        samples = scrape(router.url)
        assert samples.get("router_retries_total") == 0
        assert sample(samples, "router_drain_refusals_total", worker=urls[0]) == 0


def test_probes_take_a_draining_worker_out_and_bring_it_back_after_a_200() -> None:
    first, second = Drainable("a"), Drainable("b")
    with drainables(first, second) as urls, running_router(urls) as router:
        assert router.post("/generate", json={"input_ids": IDS}).json()["worker"] == "a"
        first.draining = True
        assert wait_until(lambda: router.workers()[urls[0]]["state"] == "draining"), \
            "the probes never marked the worker draining"
        for _ in range(3):
            assert router.post("/generate", json={"input_ids": IDS}).json()["worker"] == "b"
        assert first.refused == 0  # out before any request was refused
        first.draining = False  # restarted at the same URL
        assert wait_until(lambda: router.workers()[urls[0]]["state"] == "up"), \
            "the worker never came back after answering 200"
        assert router.post("/generate", json={"input_ids": IDS}).json()["worker"] == "a"


def test_no_request_fails_while_a_worker_drains_under_load() -> None:
    """Clients keep sending while the first worker starts draining; the request it was
    running when it began finishes there; every answer is a 200."""
    hold = threading.Event()
    first, second = Drainable("a", hold=hold), Drainable("b")
    with drainables(first, second) as urls, running_router(urls) as router, \
            ThreadPoolExecutor(4) as pool:
        running = pool.submit(router.post, "/generate", json={"input_ids": IDS}, timeout=60)
        assert first.holding.wait(60), "the first request never reached the worker"
        first.hold = None
        first.draining = True  # with one request still running
        answers = list(pool.map(
            lambda _: router.post("/generate", json={"input_ids": IDS}, timeout=60),
            range(20)))
        hold.set()
        assert [a.status_code for a in answers] == [200] * 20
        assert running.result().status_code == 200
        assert running.result().json()["worker"] == "a"  # it finished where it ran
        # Refused only by the requests sent before its first refusal (or probe) was heard:
        # at most one per client thread left.
        assert first.refused <= 3
        assert second.served == 20


def test_aborts_reach_draining_workers() -> None:
    first, second = Drainable("a", draining=True), Drainable("b")
    with drainables(first, second) as urls, running_router(urls) as router:
        assert wait_until(lambda: router.workers()[urls[0]]["state"] == "draining")
        response = router.post("/abort_request", json={"rid": "r1"})
        assert response.status_code == 200, response.text
        assert first.aborts == 1 and second.aborts == 1


def test_the_pd_router_sends_a_pair_refused_as_draining_to_a_fresh_pair() -> None:
    """One prefill and one decode instance of two drain; no probe runs (60 s). Every
    request gets its answer; once each refusal was heard, the draining ones get nothing."""
    rooms = Rooms()
    prefills = [FakeInstance("prefill", rooms, draining=True), FakeInstance("prefill", rooms)]
    decodes = [FakeInstance("decode", rooms, draining=True), FakeInstance("decode", rooms)]
    with fake_instances(*prefills, *decodes) as (p0, p1, d0, d1), running_pd_router(
        [PrefillEndpoint(p0), PrefillEndpoint(p1)], [d0, d1], health_interval_s=60,
    ) as router:
        for stream in (False, True, False, True):
            response = router.post("/generate", json={"input_ids": IDS, "stream": stream})
            assert response.status_code == 200, response.text
        listed = router.get("/workers").json()
        states = {w["url"]: w["state"] for pool in ("prefill", "decode") for w in listed[pool]}
        assert states == {p0: "draining", p1: "up", d0: "draining", d1: "up"}
        seen = len(prefills[0].requests), len(decodes[0].requests)
        for _ in range(4):
            assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
        assert (len(prefills[0].requests), len(decodes[0].requests)) == seen
        assert sample(scrape(router.url), "router_drain_refusals_total", worker=p0) == 1
