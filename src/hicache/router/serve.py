"""``hicache router``: discover the workers, then serve the router app with uvicorn.

Start-up fails (exit status 2, the reason logged) when a --worker-urls worker
does not answer /get_server_info within --worker-startup-timeout, or when its
page size or model differs from the first worker's: a router that silently
served half its workers would be worse than none.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence

import uvicorn

from hicache.router.app import create_router_app
from hicache.router.settings import RouterSettings, SettingsError, settings_from_args
from hicache.router.types import RoutingPolicy, TierIndex
from hicache.router.workers import (
    WorkerError,
    WorkerInfo,
    WorkerUnreachableError,
    check_compatible,
    fetch_worker_info_sync,
)

# TODO(merge): the index and the policies come from their own modules.
# from hicache.router.index import PageIndex
# from hicache.router.policy import build_policy

logger = logging.getLogger("hicache.router")

IndexFactory = Callable[[], TierIndex]
PolicyFactory = Callable[[TierIndex, RouterSettings], RoutingPolicy]
GRACEFUL_SHUTDOWN_S = 10
_RETRY_S = 0.5


class RouterStartupError(Exception):
    """The router cannot start; the message says why and what to change."""


def discover_workers(
    urls: Sequence[str], timeout_s: float, retry_s: float = _RETRY_S,
) -> list[WorkerInfo]:
    """Each worker's info, waiting up to ``timeout_s`` for those still starting; all
    checked against the first. RouterStartupError on a mismatch or a worker that never
    answered."""
    deadline = time.monotonic() + timeout_s
    infos: list[WorkerInfo] = []
    for url in urls:
        while True:
            try:
                info = fetch_worker_info_sync(url)
                break
            except WorkerUnreachableError as error:
                if time.monotonic() + retry_s > deadline:
                    raise RouterStartupError(f"{error} (waited {timeout_s:g} s: "
                                             "--worker-startup-timeout)") from None
                time.sleep(retry_s)
            except WorkerError as error:
                raise RouterStartupError(str(error)) from None
        if infos:
            try:
                check_compatible(info, infos[0])
            except WorkerError as error:
                raise RouterStartupError(str(error)) from None
        infos.append(info)
        logger.info("worker %s: model %r, page size %d", url, info.model, info.page_size)
    return infos


def run_router(
    settings: RouterSettings, index_factory: IndexFactory, policy_factory: PolicyFactory,
) -> None:
    """Serve until stopped; RouterStartupError when the workers cannot be used."""
    workers = discover_workers(settings.worker_urls, settings.worker_startup_timeout_s)
    index = index_factory()
    app = create_router_app(settings, index, policy_factory(index, settings), workers)
    level = logging.getLogger().getEffectiveLevel()
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, log_level=level,
        access_log=level <= logging.DEBUG, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uvicorn.Server(config).run()


def _default_factories() -> tuple[IndexFactory, PolicyFactory]:
    # TODO(merge): return PageIndex, and a factory calling build_policy(settings.policy.value,
    # index, shared, ScoringConfig(...)) with the shared-pool lookup of --shared-cache-type.
    raise RouterStartupError("this build has no routing policies yet (hicache.router.policy)")


def main(
    args: argparse.Namespace, factories: tuple[IndexFactory, PolicyFactory] | None = None,
) -> int:
    """``factories``: the index and policy to route with (default: the project's)."""
    try:
        settings = settings_from_args(args)
        index_factory, policy_factory = factories or _default_factories()
        run_router(settings, index_factory, policy_factory)
    except (SettingsError, RouterStartupError) as error:
        logger.error("cannot start the router: %s", error)
        return 2
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
        return 130
    return 0
