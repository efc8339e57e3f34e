"""Health: a worker leaves routing after failures in a row or a refused connection, never
for being slow, and the last healthy one of a pool is kept even when it seems hung.

Real HTTP servers on loopback. The registry's own tests probe by hand (one call, one
probe: no clock decides); the routers' run their probe loops with a 0.2 s interval and a
0.2 s probe timeout, which a loaded machine misses all the time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.router.health import FAILURES_TO_EJECT
from hicache.router.settings import PrefillEndpoint
from hicache.router.workers import WorkerInfo, WorkerRegistry
from tests.restartable_server import RestartableServer
from tests.router_fakes import DictIndex
from tests.router_fixtures import running_pd_router, running_router
from tests.router_pd_fakes import FakeInstance, Rooms, fake_instances
from tests.server_fixtures import serve_app_in_thread
from tests.waiting import wait_until

IDS = list(range(100, 110))
SLOW_S = 3.0  # a /health this slow misses every 0.2 s probe timeout
PATIENT_S = 5.0  # a probe timeout no quick answer misses, even on a loaded machine
QUICK_S = 0.2  # the probe timeout of the slow workers' tests


@dataclass
class Health:
    """What a stand-in worker's /health does: its status, after a delay."""

    status: int = 200
    delay_s: float = 0.0
    checks: int = 0


def health_app(health: Health) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def answer() -> Response:
        health.checks += 1
        await asyncio.sleep(health.delay_s)  # a slow health check, on purpose
        return JSONResponse({}, status_code=health.status)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, object]:
        return {"page_size": 4, "served_model_name": "tiny-model"}

    @app.post("/generate")
    async def generate() -> dict[str, object]:
        return {"text": "ok"}

    return app


@contextmanager
def stand_ins(*healths: Health) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_app_in_thread(health_app(h))) for h in healths]


def with_registry(
    urls: list[str], scenario: Callable[[WorkerRegistry, DictIndex], Awaitable[None]],
    probe_timeout_s: float = PATIENT_S,
) -> None:
    """Run ``scenario`` on a registry of ``urls``, probed by hand. Its probes wait
    ``probe_timeout_s`` (the registry's interval, under its 5 s cap): by default long
    enough that a loaded machine never turns a quick answer into a timeout."""
    async def run() -> None:
        async with httpx.AsyncClient() as client:
            index = DictIndex()
            registry = WorkerRegistry(index, client, health_interval_s=probe_timeout_s)
            for url in urls:
                registry.add(WorkerInfo(url=url, page_size=4, model="tiny-model"))
            try:
                await scenario(registry, index)
            finally:
                await registry.stop()

    asyncio.run(run())


def healthy(registry: WorkerRegistry, url: str) -> bool:
    worker = registry.get(url)
    assert worker is not None
    return worker.healthy


def test_failing_probes_take_a_worker_out_only_when_they_come_in_a_row() -> None:
    health = Health(status=503)
    with stand_ins(health) as (url,):
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            for _ in range(FAILURES_TO_EJECT - 1):
                await registry.probe_all()
                assert healthy(registry, url)
            health.status = 200  # one answer ends the streak
            await registry.probe_all()
            health.status = 503
            for _ in range(FAILURES_TO_EJECT - 1):
                await registry.probe_all()
                assert healthy(registry, url)
            await registry.probe_all()
            assert not healthy(registry, url)
            assert index.removed == [url]
            health.status = 200  # back at its first good answer
            await registry.probe_all()
            assert healthy(registry, url)

        with_registry([url], scenario)


def test_5xx_answers_to_requests_count_as_failures_and_other_answers_end_the_streak() -> None:
    with stand_ins(Health()) as (url,):
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            for status in (500, 503, 200, 502, 504, 404):  # no three 5xx in a row
                await registry.answered(url, status)
            assert healthy(registry, url)
            for _ in range(FAILURES_TO_EJECT):
                await registry.answered(url, 500)
            assert not healthy(registry, url)

        with_registry([url], scenario)


def test_a_refused_connection_takes_a_worker_out_at_once() -> None:
    server = RestartableServer(health_app(Health()))
    with server:
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            await registry.probe_all()
            assert healthy(registry, server.url)
            server.stop()  # nothing listens there any more
            await registry.probe_all()
            assert not healthy(registry, server.url)
            assert index.removed == [server.url]
            server.start()
            await registry.probe_all()
            assert healthy(registry, server.url)

        with_registry([server.url], scenario)


def test_a_slow_worker_stays_in_routing() -> None:
    health = Health(delay_s=SLOW_S)
    with stand_ins(health) as (url,):
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            for _ in range(5):  # each probe times out
                await registry.probe_all()
            assert health.checks == 5
            assert healthy(registry, url)
            assert index.removed == []

        with_registry([url], scenario, QUICK_S)


def test_a_hung_worker_leaves_only_while_another_one_is_healthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hung: nothing but timeouts for HUNG_AFTER_S (here 0). The last healthy worker of
    a registry is kept all the same; with another one healthy, it leaves routing."""
    monkeypatch.setattr("hicache.router.health.HUNG_AFTER_S", 0.0)
    hung, other = Health(delay_s=SLOW_S), Health(status=503)
    with stand_ins(hung, other) as (hung_url, other_url):
        async def scenario(registry: WorkerRegistry, index: DictIndex) -> None:
            for _ in range(FAILURES_TO_EJECT):  # the other one fails its way out first
                await registry.answered(other_url, 500)
            assert not healthy(registry, other_url)
            for _ in range(3):  # the hung one's probes time out; the other's fail
                await registry.probe_all()
            assert healthy(registry, hung_url)  # the last healthy one
            other.status = 200
            await probe_until(registry, lambda: healthy(registry, other_url), "other back")
            # With the other one healthy, the hung one goes at its next probe.
            await probe_until(registry, lambda: not healthy(registry, hung_url), "hung out")
            assert healthy(registry, other_url)

        with_registry([hung_url, other_url], scenario, QUICK_S)


async def probe_until(registry: WorkerRegistry, condition: Callable[[], bool], what: str,
                      ) -> None:
    """Probe again and again until ``condition`` (a quick answer may still miss a 0.2 s
    probe timeout on a loaded machine)."""
    deadline = time.monotonic() + 60.0
    while not condition():
        assert time.monotonic() < deadline, what
        await registry.probe_all()


def test_the_only_decode_instance_stays_routable_while_its_health_probe_is_slow() -> None:
    """The PD router's probe loop (0.2 s timeout) against an only decode instance whose
    /health takes seconds, as a busy one's did: /health stays 200, requests are served."""
    rooms = Rooms()
    prefill, decode = FakeInstance("prefill", rooms), FakeInstance("decode", rooms)
    with fake_instances(prefill, decode) as (p, d), running_pd_router(
        [PrefillEndpoint(p)], [d],
    ) as router:
        decode.health_delay_s = SLOW_S
        seen = decode.health_checks
        assert wait_until(lambda: decode.health_checks >= seen + 5, 30.0)  # probes timed out
        health = router.get("/health")
        assert health.status_code == 200, health.text
        assert health.json()["healthy_decode"] == 1
        response = router.post("/generate", json={"input_ids": IDS})
        assert response.status_code == 200, response.text


def test_the_router_keeps_a_slow_worker_and_drops_one_that_refuses() -> None:
    slow = Health(delay_s=SLOW_S)
    refusing = RestartableServer(health_app(Health()))
    with stand_ins(slow) as (slow_url,), refusing, running_router(
        [slow_url, refusing.url],
    ) as router:
        refusing.stop()
        assert wait_until(lambda: not router.workers()[refusing.url]["healthy"], 30.0)
        assert wait_until(lambda: slow.checks >= 5, 30.0)
        assert router.workers()[slow_url]["healthy"] is True
        assert router.post("/generate", json={"input_ids": IDS}).status_code == 200
