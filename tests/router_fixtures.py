"""A real router app on a loopback port in front of fake workers, with a dict index."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from hicache.router.app import create_router_app
from hicache.router.pd_app import create_pd_router_app
from hicache.router.serve import discover_workers
from hicache.router.settings import PrefillEndpoint, RouterSettings
from hicache.router.types import RoutingPolicy, TierCosts, TierIndex
from hicache.router.workers import WorkerInfo
from tests.router_fakes import DictIndex, FirstPolicy
from tests.server_fixtures import serve_app_in_thread

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


@contextmanager
def running_pd_router(
    prefill: Sequence[PrefillEndpoint], decode_urls: Sequence[str], *,
    policy: RoutingPolicy | None = None, index: TierIndex | None = None,
    extra_prefill: Sequence[WorkerInfo] = (), extra_decode: Sequence[WorkerInfo] = (),
    **settings: Any,
) -> Iterator[RunningRouter]:
    """The --pd-disaggregation router over discovered ``prefill`` and ``decode_urls``,
    after ``extra_prefill`` / ``extra_decode`` (registered as given, first: instances that
    would not answer discovery; their bootstrap port is 8998)."""
    settings.setdefault("health_interval_s", HEALTH_INTERVAL_S)
    endpoints = [*prefill, *(PrefillEndpoint(i.url) for i in extra_prefill)]
    config = RouterSettings(pd_disaggregation=True, prefill=tuple(endpoints),
                            decode_urls=(*decode_urls, *(i.url for i in extra_decode)),
                            worker_startup_timeout_s=5, **settings)
    found_prefill = discover_workers([e.url for e in prefill], timeout_s=5)
    found_decode = discover_workers(decode_urls, timeout_s=5)
    chosen_index = index if index is not None else DictIndex()
    chosen = policy if policy is not None else FirstPolicy(
        chosen_index if isinstance(chosen_index, DictIndex) else None)
    app = create_pd_router_app(config, chosen_index, chosen,
                               [*extra_prefill, *found_prefill], [*extra_decode, *found_decode])
    with serve_app_in_thread(app, lifespan="on") as url:
        yield RunningRouter(url, chosen_index, chosen)  # type: ignore[arg-type]
