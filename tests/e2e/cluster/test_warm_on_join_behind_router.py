"""Warm-on-join behind a real ``hicache router``: a worker restarted at its port is warmed
from the shared L3 before the router routes to it, and answers from its host tier.

Two tiny ``hicache serve`` workers (CPU, KV events on, write through to a shared file
L3) sit behind ``hicache router``. Prompts go through the router; the worker that
served the first one is restarted (SIGTERM: it drains and exits 0; a new process at
the same port with the same flags). The router sees it come back, posts
/hicache/warm with the prompts it routed most recently, and routes to it once that
is done. Checked: the router warmed it (``router_warms_total{outcome="warmed"}``,
tokens) and sent it nothing before; the restarted worker's first request on the
prompt the old process served is an L2 (host) hit over every whole page, with the
greedy tokens of the cold answer.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.bench.cluster import KV_EVENTS_FLAG, EventEndpoints
from hicache.bench.scrape import scrape
from hicache.net import free_port
from hicache.testing.server_process import ChildServer, ServerProcess
from tests.waiting import wait_until

PAGE = 16
WORKER_FLAGS = (
    "--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
    "--page-size", str(PAGE), "--num-threads", "1", "--max-total-tokens", "4096",
    "--hicache-ratio", "2", "--hicache-write-policy", "write_through",
    "--hicache-storage-prefetch-policy", "wait_complete",
    # A tiny prompt may be cheaper to recompute than to load: the test asserts tier hits.
    "--hicache-reuse-policy", "load",
    # /hicache/warm is an admin route: the router warms with the key the workers share.
    "--admin-api-key", "cluster-key",
)
STORE = {"prefetch_threshold": PAGE}
ROUTER_FLAGS = ("--policy", "tier_aware", "--health-interval", "0.2",
                "--warm-on-join-timeout-s", "60", "--admin-api-key", "cluster-key")
NEW_TOKENS = 4
# Prompts sharing no page: 5 whole pages and a partial one each.
PROMPTS = [[(7 * i + 11 * n) % 180 + 3 for i in range(5 * PAGE + 3)] for n in range(3)]
WHOLE = len(PROMPTS[0]) // PAGE * PAGE
# Starting a worker, a request, a drain: guards against a hang.
TIMEOUT_S = 120.0


@dataclass
class Rig:
    workers: list[ServerProcess]
    router: ChildServer
    run_dir: Path
    restarted: ChildServer | None = None


def _worker(run_dir: Path, index: int) -> ServerProcess:
    store = {"path": str(run_dir / "l3"), **STORE}
    events = EventEndpoints(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    flags = [*WORKER_FLAGS, "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", json.dumps(store),
             KV_EVENTS_FLAG, events.config_json()]
    return ServerProcess(flags, run_dir / f"worker-{index}.log",
                         startup_timeout_s=TIMEOUT_S, name=f"worker {index}")


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    workers = [_worker(tmp_path, index) for index in range(2)]
    port = free_port()
    router = ChildServer(
        [sys.executable, "-m", "hicache", "--log-level", "info", "router",
         "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *(w.url for w in workers), *ROUTER_FLAGS],
        port, tmp_path / "router.log", startup_timeout_s=TIMEOUT_S, name="the router",
    )
    rig = Rig(workers, router, tmp_path)
    try:
        for worker in workers:  # side by side: start-up is most of the test's time
            worker.launch()
        for worker in workers:
            worker.wait_ready()
        router.start()
        yield rig
    finally:
        router.stop()
        for server in (rig.restarted, *workers):
            if server is not None:
                server.stop()


def _generate(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    reply = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def _routed(router: ChildServer) -> dict[str, float]:
    return scrape(router.url).by_label("router_requests_total", "worker")


def _router_state(router: ChildServer, url: str) -> str | None:
    workers = httpx.get(f"{router.url}/workers", timeout=TIMEOUT_S).json()["workers"]
    return next((str(w["state"]) for w in workers if w["url"] == url), None)


def test_a_worker_restarted_behind_the_router_is_warmed_before_it_takes_traffic(
    rig: Rig,
) -> None:
    router = rig.router
    before = _routed(router)
    cold = _generate(router.url, PROMPTS[0])
    assert cold["meta_info"]["cached_tokens"] == 0
    after = _routed(router)
    served = next(w for w in rig.workers if after.get(w.url, 0) > before.get(w.url, 0))
    for prompt in PROMPTS[1:]:
        _generate(router.url, prompt)
    # Written through to L3 by the worker that served each prompt.
    assert wait_until(lambda: sum(
        scrape(w.url).total("hicache_l3_backup_pages_stored_total") for w in rig.workers
    ) >= len(PROMPTS) * (WHOLE // PAGE), TIMEOUT_S)

    process = served.process
    assert process is not None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=TIMEOUT_S) == 0, served.log_tail()
    assert wait_until(lambda: _router_state(router, served.url) == "down", TIMEOUT_S)
    routed_before = _routed(router).get(served.url, 0.0)
    restarted = ChildServer(served.command, served.port, rig.run_dir / "restarted.log",
                            startup_timeout_s=TIMEOUT_S, name="the restarted worker")
    rig.restarted = restarted
    restarted.start()
    assert wait_until(lambda: _router_state(router, served.url) == "up", TIMEOUT_S), \
        router.log_tail()
    metrics = scrape(router.url)
    assert metrics.total("router_warms_total", outcome="warmed") == 1, router.log_tail()
    # The three prompts' whole pages fit its host pool's warm fraction.
    assert metrics.total("router_warm_tokens_total") >= len(PROMPTS) * WHOLE
    assert _routed(router).get(served.url, 0.0) == routed_before  # nothing before the warm

    warm = _generate(restarted.url, PROMPTS[0])
    details = warm["meta_info"]["cached_tokens_details"]
    assert details["host"] == WHOLE, warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
