"""Warm-on-join behind a real router, with stand-in workers on loopback.

A worker that joins (POST /workers, or back at its URL after being down) is warming:
the router posts /hicache/warm with the most recent prompts it routed (deduplicated,
within the worker's host pool x warm fraction) and routes to it only once that
answered, failed or timed out, unless it is the only healthy worker. Start-up workers
are not warmed; ``--warm-on-join-timeout-s 0`` turns warming off.

The stand-ins answer /generate (saying who served it) and /hicache/warm as told: at
once, holding the answer until released, or with a 500. The router's policy picks the
last candidate, so a worker that joined gets the traffic once it is routable.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from hicache.router.types import RouteDecision, RouteRequest
from tests.abandoned_clients import sample, scrape
from tests.restartable_server import RestartableServer
from tests.router_fixtures import RunningRouter, running_router
from tests.server_fixtures import serve_app_in_thread
from tests.waiting import wait_until

PAGE = 4
HOST_POOL_PAGES = 40
FRACTION = 0.5  # a budget of 20 pages = 80 tokens
KEY = "admin-key"


@dataclass
class Warmable:
    name: str
    warm_mode: str = "ok"  # "ok" | "hold" | "fail"
    release: threading.Event = field(default_factory=threading.Event)
    warms: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)
    served: int = 0

    def info(self) -> dict[str, Any]:
        return {"page_size": PAGE, "served_model_name": "tiny-model",
                "memory": {"host_pool_pages": HOST_POOL_PAGES}, "l3": {"attached": True},
                "hicache_warm_host_fraction": FRACTION, "context_length": 1024}


def warmable_app(worker: Warmable) -> FastAPI:
    app = FastAPI()

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return worker.info()

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({})

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        await request.json()
        worker.served += 1
        return {"text": worker.name}

    @app.post("/hicache/warm")
    async def warm(request: Request) -> Response:
        worker.warms.append((await request.json(), request.headers.get("authorization")))
        if worker.warm_mode == "fail":
            return JSONResponse({"error": "no"}, status_code=500)
        while worker.warm_mode == "hold" and not worker.release.is_set():
            await asyncio.sleep(0.02)  # a slow warm on purpose, until the test releases it
        items = worker.warms[-1][0]["input_ids"]
        return JSONResponse({"results": [], "tokens": sum(len(i) for i in items)})

    return app


class LastPolicy:
    name = "last"

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        return RouteDecision(worker=request.workers[-1].url, policy=self.name)


@contextmanager
def serving(*workers: Warmable) -> Iterator[list[str]]:
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_app_in_thread(warmable_app(w))) for w in workers]
        yield urls
        for worker in workers:
            worker.release.set()


def prompt(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def generate(router: RunningRouter, ids: list[int]) -> str:
    response = router.post("/generate", json={"input_ids": ids})
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


def add(router: RunningRouter, url: str) -> None:
    response = router.post("/workers", json={"url": url},
                           headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 201, response.text


def state(router: RunningRouter, url: str) -> str:
    return str(router.workers()[url]["state"])


def test_a_joining_worker_is_warmed_with_the_recent_prompts_before_it_is_routed_to() -> None:
    old, new = Warmable("old"), Warmable("new", warm_mode="hold")
    with serving(old, new) as (old_url, new_url), running_router(
        [old_url], policy=LastPolicy(), admin_api_key=KEY, warm_on_join_timeout_s=60,
    ) as router:
        first, second, third = prompt(1000, 6), prompt(2000, 9), prompt(3000, 8)
        for ids in (first, second, third):
            assert generate(router, ids) == "old"
        turn = [*first, *prompt(5000, 2)]  # the first conversation's next turn (8 pages)
        assert generate(router, turn) == "old"
        assert old.warms == []  # a start-up worker is not warmed
        add(router, new_url)
        assert wait_until(lambda: new.warms)
        assert state(router, new_url) == "warming"
        assert router.workers()[new_url]["warming"] is True
        assert generate(router, prompt(7000, 1)) == "old"  # not routed to while warming
        body, authorization = new.warms[0]
        # Most recent first, whole pages within 20: the turn (8), the third prompt (8); the
        # second (9) does not fit the 4 left. The key the workers share goes with it.
        assert body["input_ids"] == [turn, third]
        assert authorization == f"Bearer {KEY}" and 0 < body["timeout_s"] < 60
        new.release.set()
        assert wait_until(lambda: state(router, new_url) == "up")
        assert generate(router, prompt(8000, 1)) == "new"
        samples = scrape(router.url)
        assert sample(samples, "router_warms_total", outcome="warmed") == 1.0
        assert sample(samples, "router_warm_tokens_total") == 16 * PAGE
        assert sample(samples, "router_worker_warming", worker=new_url) == 0.0


def test_a_warm_that_times_out_or_fails_only_counts_and_the_worker_is_routed_to() -> None:
    old = Warmable("old")
    slow, broken = Warmable("slow", warm_mode="hold"), Warmable("broken", warm_mode="fail")
    with serving(old, slow, broken) as (old_url, slow_url, broken_url):
        # A timeout no loaded machine reaches: the broken worker's 500 is what ends its warm.
        with running_router([old_url], policy=LastPolicy(), admin_api_key=KEY,
                            warm_on_join_timeout_s=60) as router:
            generate(router, prompt(1000, 3))
            add(router, broken_url)
            assert wait_until(lambda: state(router, broken_url) == "up")
            assert len(broken.warms) == 1
            assert generate(router, prompt(2000, 1)) == "broken"
            samples = scrape(router.url)
            assert sample(samples, "router_warms_total", outcome="failed") == 1.0
            assert sample(samples, "router_warms_total", outcome="timeout") == 0.0
            assert sample(samples, "router_warm_tokens_total") == 0.0
        # The slow worker never answers: its warm ends at the (short) timeout, however
        # late.
        with running_router([old_url], policy=LastPolicy(), admin_api_key=KEY,
                            warm_on_join_timeout_s=1.0) as router:
            generate(router, prompt(1000, 3))
            add(router, slow_url)
            assert wait_until(lambda: state(router, slow_url) == "up")
            assert len(slow.warms) == 1
            assert generate(router, prompt(3000, 1)) == "slow"
            samples = scrape(router.url)
            assert sample(samples, "router_warms_total", outcome="timeout") == 1.0
            assert sample(samples, "router_warms_total", outcome="failed") == 0.0
            assert sample(samples, "router_warm_tokens_total") == 0.0


def test_the_only_healthy_worker_is_routed_to_while_it_warms() -> None:
    old, new = Warmable("old"), Warmable("new", warm_mode="hold")
    with serving(old, new) as (old_url, new_url), running_router(
        [old_url], policy=LastPolicy(), admin_api_key=KEY, warm_on_join_timeout_s=60,
    ) as router:
        generate(router, prompt(1000, 3))
        response = httpx.delete(f"{router.url}/workers", params={"url": old_url},
                                headers={"authorization": f"Bearer {KEY}"}, timeout=10)
        assert response.status_code == 200, response.text
        add(router, new_url)
        assert wait_until(lambda: new.warms)
        assert state(router, new_url) == "warming"
        assert generate(router, prompt(2000, 1)) == "new"


def test_a_worker_restarted_at_its_url_is_warmed_again() -> None:
    other, restarted = Warmable("other"), Warmable("restarted")
    server = RestartableServer(warmable_app(restarted))
    with serving(other) as (other_url,), server, running_router(
        [other_url, server.url], policy=LastPolicy(), admin_api_key=KEY,
    ) as router:
        assert generate(router, prompt(1000, 3)) == "restarted"
        server.stop()
        assert wait_until(lambda: state(router, server.url) == "down")
        assert generate(router, prompt(2000, 2)) == "other"
        server.start()
        assert wait_until(lambda: state(router, server.url) == "up")
        assert [body["input_ids"] for body, _ in restarted.warms] == [
            [prompt(2000, 2), prompt(1000, 3)]
        ]
        assert generate(router, prompt(3000, 1)) == "restarted"


def test_with_warming_off_a_joining_worker_is_routed_to_at_once() -> None:
    old, new = Warmable("old"), Warmable("new")
    with serving(old, new) as (old_url, new_url), running_router(
        [old_url], policy=LastPolicy(), admin_api_key=KEY, warm_on_join_timeout_s=0,
    ) as router:
        generate(router, prompt(1000, 3))
        add(router, new_url)
        assert state(router, new_url) == "up"
        assert generate(router, prompt(2000, 1)) == "new"
        assert new.warms == []


def test_a_worker_that_goes_down_while_warming_is_warmed_again_when_it_is_back() -> None:
    old, slow = Warmable("old"), Warmable("slow", warm_mode="hold")
    server = RestartableServer(warmable_app(slow))
    try:
        with serving(old) as (old_url,), server, running_router(
            [old_url], policy=LastPolicy(), admin_api_key=KEY, warm_on_join_timeout_s=60,
        ) as router:
            generate(router, prompt(1000, 3))
            add(router, server.url)
            assert wait_until(lambda: len(slow.warms) == 1)
            server.stop()  # its first warm breaks off with it
            assert wait_until(lambda: state(router, server.url) == "down")
            assert router.workers()[server.url]["warming"] is False
            server.start()
            assert wait_until(lambda: len(slow.warms) == 2)
            # The first warm broke off (failed); the second keeps it warming.
            assert wait_until(lambda: sample(scrape(router.url), "router_warms_total",
                                             outcome="failed") == 1.0)
            assert state(router, server.url) == "warming"
            assert generate(router, prompt(2000, 1)) == "old"
            slow.release.set()
            assert wait_until(lambda: state(router, server.url) == "up")
            assert generate(router, prompt(3000, 1)) == "slow"
    finally:
        slow.release.set()
