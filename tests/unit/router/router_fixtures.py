"""A real router app on a loopback port in front of fake workers, with a dict index."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from hicache.router.app import create_router_app
from hicache.router.serve import discover_workers
from hicache.router.settings import RouterSettings
from hicache.router.types import RoutingPolicy, TierCosts
from hicache.router.workers import WorkerInfo
from tests.server_fixtures import serve_app_in_thread
from tests.unit.router.fakes import DictIndex, FirstPolicy

HEALTH_INTERVAL_S = 0.2


@dataclass
class RunningRouter:
    url: str
    index: DictIndex
    policy: Any

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10, **kwargs)

    def post(self, path: str, timeout: float = 10, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=timeout, **kwargs)

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in self.get("/workers").json()["workers"]}


@contextmanager
def running_router(
    worker_urls: Sequence[str] = (), *, policy: RoutingPolicy | None = None,
    extra_workers: Sequence[WorkerInfo] = (), tier_costs: dict[str, TierCosts] | None = None,
    **settings: Any,
) -> Iterator[RunningRouter]:
    """The router over ``extra_workers`` (registered first, as given: workers that would
    not answer discovery) and ``worker_urls`` (discovered)."""
    settings.setdefault("health_interval_s", HEALTH_INTERVAL_S)
    config = RouterSettings(worker_urls=tuple(worker_urls), **settings)
    index = DictIndex()
    chosen = policy if policy is not None else FirstPolicy(index)
    infos = [*extra_workers, *discover_workers(config.worker_urls, timeout_s=5)]
    app = create_router_app(config, index, chosen, infos, tier_costs=tier_costs)
    with serve_app_in_thread(app, lifespan="on") as url:
        yield RunningRouter(url, index, chosen)
