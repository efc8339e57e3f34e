"""``hicache router``: discover the workers, then serve the router app with uvicorn.

Start-up fails (exit status 2, the reason logged) when a --worker-urls worker
does not answer /get_server_info within --worker-startup-timeout, or when its
page size or model differs from the first worker's: a router that silently
served half its workers would be worse than none. With --pd-disaggregation the
same holds over the --prefill and --decode instances together (the KV moves
between them page by page), and an instance that reports the wrong
``disaggregation_mode`` (a decode instance given as --prefill, or an ordinary
one) is refused too. Every log line passes ``credentials.RedactingFilter``: a
worker URL's user and password never reach the log.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import uvicorn

from hicache.router.app import create_router_app
from hicache.router.credentials import install_log_redaction
from hicache.router.index import PageIndex
from hicache.router.pd_app import create_pd_router_app
from hicache.router.pd_pools import DisaggregationMode
from hicache.router.policy import ScoringConfig, build_policy
from hicache.router.settings import (
    RouterSettings,
    SettingsError,
    SharedCacheType,
    TierCostsMode,
    settings_from_args,
)
from hicache.router.shared_pool import shared_pool_for_worker
from hicache.router.types import RoutingPolicy, TierCosts, TierIndex
from hicache.router.workers import (
    WorkerError,
    WorkerInfo,
    WorkerUnreachableError,
    check_compatible,
    fetch_worker_info_sync,
)

logger = logging.getLogger("hicache.router")

IndexFactory = Callable[[], TierIndex]
# (index, settings, the discovered workers, the measured tier costs the policy reads)
PolicyFactory = Callable[
    [TierIndex, RouterSettings, Sequence[WorkerInfo], Mapping[str, TierCosts]], RoutingPolicy
]
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


def discover_pd_workers(
    settings: RouterSettings, retry_s: float = _RETRY_S,
) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
    """(prefill infos, decode infos), all checked against the first prefill instance and
    against the mode each reports; RouterStartupError otherwise."""
    prefill_urls = [p.url for p in settings.prefill]
    infos = discover_workers([*prefill_urls, *settings.decode_urls],
                             settings.worker_startup_timeout_s, retry_s)
    prefill, decode = infos[:len(prefill_urls)], infos[len(prefill_urls):]
    for expected, group in ((DisaggregationMode.PREFILL, prefill),
                            (DisaggregationMode.DECODE, decode)):
        for info in group:
            # Servers that do not report a mode (SGLang's before it did) are taken on trust.
            mode = info.server_info.get("disaggregation_mode")
            if mode is not None and mode != expected.value:
                raise RouterStartupError(
                    f"{info.url} is given as --{expected.value} but runs with "
                    f"--disaggregation-mode {mode}")
    return prefill, decode


def run_router(
    settings: RouterSettings, index_factory: IndexFactory, policy_factory: PolicyFactory,
) -> None:
    """Serve until stopped; RouterStartupError when the workers cannot be used."""
    decode: list[WorkerInfo] = []
    if settings.pd_disaggregation:
        workers, decode = discover_pd_workers(settings)
    else:
        workers = discover_workers(settings.worker_urls, settings.worker_startup_timeout_s)
    index = index_factory()
    costs: dict[str, TierCosts] | None = None
    if settings.tier_costs is TierCostsMode.MEASURED:
        costs = {}
    # With PD the policy chooses among the prefill instances: they compute the prefixes.
    policy = policy_factory(index, settings, workers, {} if costs is None else costs)
    if settings.pd_disaggregation:
        app = create_pd_router_app(settings, index, policy, workers, decode, tier_costs=costs)
    else:
        app = create_router_app(settings, index, policy, workers, tier_costs=costs)
    level = logging.getLogger().getEffectiveLevel()
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, log_level=level,
        access_log=level <= logging.DEBUG, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uvicorn.Server(config).run()


def build_default_policy(
    index: TierIndex, settings: RouterSettings, workers: Sequence[WorkerInfo],
    costs: Mapping[str, TierCosts],
) -> RoutingPolicy:
    """The project's policy named by ``--policy``, scoring as the flags say; with
    ``--shared-cache-type hicache`` it asks the L3 the first worker reports (every worker
    shares it: they have one model and page size, so one key namespace)."""
    shared = None
    if settings.shared_cache_type is SharedCacheType.HICACHE:
        if not workers:
            raise RouterStartupError("--shared-cache-type hicache needs a worker in "
                                     "--worker-urls to learn the shared L3 from")
        try:
            shared = shared_pool_for_worker(workers[0].server_info)
        except ValueError as error:
            raise RouterStartupError(f"--shared-cache-type hicache: worker {workers[0].url}: "
                                     f"{error}") from None
    config = ScoringConfig(
        overlap_weight=settings.overlap_weight,
        shared_cache_multiplier=settings.shared_cache_multiplier,
        tier_costs=settings.tier_costs.value,
        conversation_affinity=settings.conversation_affinity, load_term=settings.load_term,
        ttft_score=settings.ttft_score,
    )
    return build_policy(settings.policy.value, index, shared, config, costs)


def _default_factories() -> tuple[IndexFactory, PolicyFactory]:
    return PageIndex, build_default_policy


def main(
    args: argparse.Namespace, factories: tuple[IndexFactory, PolicyFactory] | None = None,
) -> int:
    """``factories``: the index and policy to route with (default: the project's)."""
    install_log_redaction()  # before the first line that may name a worker
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
