"""The workers the router sends requests to: discovery, compatibility, health, load.

A worker is discovered from its ``/get_server_info``: page size, model, where
it publishes KV events (``kv_events_endpoint`` / ``kv_events_replay_endpoint``
/ ``kv_events_topic``, or SGLang's ``kv_events_config`` JSON) and, when it has
one, the seed of its L3 keys. Every worker must have the first one's page size
and model: the router hashes a request's pages once, with one page size and
one tokenizer, for all of them. A worker that differs is refused with both
values named.

The registry owns each worker's event subscriber. What its health probes (``GET
/health`` every ``health_interval_s``) and the proxied requests say of a worker
decides whether it stays in routing (``health.py``): a refused connection takes it
out at once, other failures after three in a row, and slowness (timeouts) never,
unless it answered nothing for half a minute while another worker of this registry
is healthy. Out of routing, its index entries are dropped (its caches may be gone);
when it answers /health again it is rediscovered (a restarted worker may publish
elsewhere) and its subscriber rebuilds its entries from the replay buffer.

A draining worker (``drain.py``: its /health answers 503 ``{"status": "draining"}``,
or it refused a proxied request as draining) leaves routing at once, without a
failure: it is not down, its running requests finish there. Its event subscriber
keeps going (what it writes to L3 while draining is the shared pool's), and it
returns to routing only at a /health 200 (a worker restarted at the same URL),
rediscovered as a down worker is; a refused probe takes it down (it exited).
Invariant: a draining worker is never ``healthy`` (in routing).

A worker that joins (added through the admin API, or a known worker back after being
down or draining) is first *warming* (``warm.py``): healthy and probed, but routed to
only while no other healthy worker is done warming (``routable``), until its warm
answered or timed out. Invariant: a warming worker is healthy; leaving routing ends
its warming.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import zmq.asyncio

from hicache.engine.reuse_plan import CostSnapshot
from hicache.router.credentials import redact
from hicache.router.drain import is_draining_health
from hicache.router.health import (
    HUNG_AFTER_S,
    Signal,
    Verdict,
    WorkerHealth,
    signal_of_error,
    signal_of_status,
)
from hicache.router.ledger import PrefillLedger
from hicache.router.live_costs import cache_usage, worker_cost_snapshot
from hicache.router.settings import normalize_worker_url
from hicache.router.subscriber import EventEndpoints, EventSubscriber, SubscriberCounts
from hicache.router.tier_costs import measured_tier_costs, prometheus_samples
from hicache.router.types import TierCosts, TierIndex, WorkerLoad

if TYPE_CHECKING:
    from hicache.router.warm import JoinWarmer

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 5.0
MAX_PROBE_TIMEOUT_S = 5.0
# Addresses a publisher binds to that mean "every interface": reached at the worker's host.
_ANY_HOST = frozenset({"*", "0.0.0.0", "::", "[::]"})


class WorkerError(Exception):
    """A worker the registry cannot take; ``status`` is the admin API's answer. Its message
    names workers without the credentials of their URLs: it reaches clients and logs."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class WorkerUnreachableError(WorkerError):
    status = 502


class WorkerMismatchError(WorkerError):
    """Its page size or model differs from the other workers'."""

    status = 409


class WorkerExistsError(WorkerError):
    status = 409


class UnknownWorkerError(WorkerError):
    status = 404


@dataclass(frozen=True)
class WorkerInfo:
    url: str
    page_size: int
    model: str  # the served model name (what clients send), else the model path
    model_path: str | None = None
    tokenizer_path: str | None = None  # a dir the router can load the tokenizer from
    events: EventEndpoints | None = None  # None: the worker publishes no KV events
    l3_key_seed: str | None = None  # seeds the worker's L3 keys, when it reports one
    # The whole /get_server_info answer (the shared-pool lookup and tier costs read it).
    server_info: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def public(self) -> dict[str, Any]:
        events = self.events
        return {
            "url": redact(self.url), "page_size": self.page_size, "model": self.model,
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
            "kv_events_endpoint": events.endpoint if events else None,
            "kv_events_replay_endpoint": events.replay_endpoint if events else None,
            "kv_events_topic": events.topic if events else None,
            "hicache_l3_key_seed": self.l3_key_seed,
        }


def parse_server_info(url: str, info: Mapping[str, Any]) -> WorkerInfo:
    """A worker's /get_server_info answer as a WorkerInfo; WorkerError when it lacks what
    routing needs."""
    page_size = info.get("page_size")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise WorkerError(f"worker {url}: /get_server_info has no valid page_size "
                          f"(got {page_size!r})")
    model_path = _text(info.get("model_path"))
    model = _text(info.get("served_model_name")) or model_path
    if model is None:
        raise WorkerError(f"worker {url}: /get_server_info names no model "
                          "(served_model_name or model_path)")
    seed = info.get("hicache_l3_key_seed")
    return WorkerInfo(
        url=url, page_size=page_size, model=model, model_path=model_path,
        tokenizer_path=_text(info.get("tokenizer_path")),
        events=_event_endpoints(url, info),
        l3_key_seed=None if seed is None else str(seed),
        server_info=dict(info),
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _event_endpoints(url: str, info: Mapping[str, Any]) -> EventEndpoints | None:
    config: Mapping[str, Any] = {}
    raw = info.get("kv_events_config")
    if isinstance(raw, str) and raw.strip():
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            logger.warning("worker %s: kv_events_config is not JSON: %r", url, raw)
            parsed = {}
        config = parsed if isinstance(parsed, dict) else {}
    elif isinstance(raw, Mapping):
        config = raw
    endpoint = _text(info.get("kv_events_endpoint")) or _text(config.get("endpoint"))
    if endpoint is None:
        return None
    replay = _text(info.get("kv_events_replay_endpoint")) or _text(config.get("replay_endpoint"))
    topic = info.get("kv_events_topic", config.get("topic", ""))
    host = urlsplit(url).hostname or "127.0.0.1"
    return EventEndpoints(
        endpoint=reachable_endpoint(endpoint, host),
        replay_endpoint=None if replay is None else reachable_endpoint(replay, host),
        topic=topic if isinstance(topic, str) else "",
    )


def reachable_endpoint(endpoint: str, worker_host: str) -> str:
    """A ZMQ endpoint the worker bound (``tcp://*:5557``) as the router connects to it."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname is None:
        return endpoint
    bound = parts.netloc.rsplit(":", 1)[0]
    if bound not in _ANY_HOST:
        return endpoint
    host = f"[{worker_host}]" if ":" in worker_host else worker_host
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{host}{port}"))


def check_compatible(new: WorkerInfo, reference: WorkerInfo) -> None:
    """WorkerMismatchError naming both values unless ``new`` matches ``reference``."""
    if new.page_size != reference.page_size:
        raise WorkerMismatchError(
            f"worker {new.url} has page size {new.page_size}, but {reference.url} has page "
            f"size {reference.page_size}: every worker must use the same page size (the "
            "router hashes a request's pages once for all of them)"
        )
    if new.model != reference.model:
        raise WorkerMismatchError(
            f"worker {new.url} serves model {new.model!r}, but {reference.url} serves "
            f"{reference.model!r}: every worker must serve the same model"
        )


async def fetch_worker_info(
    client: httpx.AsyncClient, url: str, timeout_s: float = DISCOVERY_TIMEOUT_S,
) -> WorkerInfo:
    try:
        response = await client.get(f"{url}/get_server_info", timeout=timeout_s)
    except httpx.HTTPError as error:
        raise WorkerUnreachableError(f"worker {url} does not answer /get_server_info: "
                                     f"{type(error).__name__}: {error}") from None
    return _info_from_response(url, response)


def fetch_worker_info_sync(url: str, timeout_s: float = DISCOVERY_TIMEOUT_S) -> WorkerInfo:
    try:
        response = httpx.get(f"{url}/get_server_info", timeout=timeout_s)
    except httpx.HTTPError as error:
        raise WorkerUnreachableError(f"worker {url} does not answer /get_server_info: "
                                     f"{type(error).__name__}: {error}") from None
    return _info_from_response(url, response)


def _info_from_response(url: str, response: httpx.Response) -> WorkerInfo:
    if response.status_code != 200:
        raise WorkerUnreachableError(
            f"worker {url}: /get_server_info answered {response.status_code}"
        )
    try:
        body = response.json()
    except ValueError:
        raise WorkerError(f"worker {url}: /get_server_info is not JSON") from None
    if not isinstance(body, dict):
        raise WorkerError(f"worker {url}: /get_server_info is not a JSON object")
    return parse_server_info(url, body)


@dataclass
class Worker:
    """A registered worker and what the router knows of it now."""

    info: WorkerInfo
    healthy: bool = True  # in routing
    draining: bool = False  # out of routing as draining (never while healthy)
    warming: bool = False  # joined, its warm not done: routed to only as a last resort
    warm_generation: int = 0  # which warm is the current one (a newer join supersedes)
    active_requests: int = 0  # proxied, not finished
    active_prompt_pages: int = 0  # prompt pages of those requests (the decode_blocks term)
    subscriber: EventSubscriber | None = None
    # Kept across subscribers (a worker going down and back): the metrics are totals.
    event_counts: SubscriberCounts = field(default_factory=SubscriberCounts)
    health: WorkerHealth = field(default_factory=WorkerHealth)
    # The prefill the proxy sent there, in predicted seconds, until each first token.
    ledger: PrefillLedger = field(default_factory=PrefillLedger)
    # Its live cost model as last probed (only for a policy that prices with it).
    live_costs: CostSnapshot | None = None
    # How full its cache was at the last probe (``live_costs.cache_usage``).
    cache_usage: float | None = None

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def state(self) -> str:
        """"up" (routed to), "warming" (up, routed to as a last resort), "draining", or
        "down"."""
        if self.healthy:
            return "warming" if self.warming else "up"
        return "draining" if self.draining else "down"

    @property
    def device_pages(self) -> float | None:
        """Its device pool in pages, as its /get_server_info says (None: it does not)."""
        tokens = self.info.server_info.get("max_total_num_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens <= 0:
            return None
        return float(tokens) / self.info.page_size

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.url, self.active_requests, float(self.active_prompt_pages),
                          queued_prefill_s=self.ledger.queued_s(),
                          decoding_requests=self.ledger.decoding, costs=self.live_costs,
                          pending_prefill_pages=self.ledger.pending_pages,
                          prefilling_requests=self.ledger.prefilling,
                          device_pages=self.device_pages, in_flight=self.ledger.in_flight(),
                          cache_usage=self.cache_usage)


class WorkerRegistry:
    """The workers in registration order; owns their subscribers and the health loop.

    Lives on the router's event loop: ``start`` there, ``stop`` before it ends.
    """

    def __init__(
        self, index: TierIndex, client: httpx.AsyncClient, *, health_interval_s: float,
        zmq_context: zmq.asyncio.Context | None = None,
        tier_costs: dict[str, TierCosts] | None = None, warmer: JoinWarmer | None = None,
        live_costs: bool = False,
    ) -> None:
        self._index = index
        # Warms joining workers (None or disabled: a joining worker is routable at once).
        self.warmer = warmer
        self._warm_tasks: set[asyncio.Task[None]] = set()
        # With --tier-costs measured: each worker's costs, refreshed from its
        # /get_server_info and /metrics at every successful probe (the policy reads them).
        self._tier_costs = tier_costs
        # For tier_aware and predicted_ttft: each worker's live cost model
        # (``Worker.live_costs``) and cache usage, read from the same answers at every
        # successful probe.
        self._live_costs = live_costs
        self._client = client
        self._health_interval_s = health_interval_s
        self._probe_timeout_s = min(health_interval_s, MAX_PROBE_TIMEOUT_S)
        self._zmq = zmq_context or zmq.asyncio.Context()
        self._own_zmq = zmq_context is None
        self._workers: dict[str, Worker] = {}
        # The first worker ever accepted fixes the page size and model: the router's
        # tokenizer and page hashes were made for them.
        self.reference: WorkerInfo | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one membership change at a time

    @property
    def page_size(self) -> int | None:
        return None if self.reference is None else self.reference.page_size

    # -- membership

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy]

    def routable(self, excluding: Collection[str] = ()) -> list[Worker]:
        """The healthy workers done warming, but for ``excluding`` (urls); all those
        healthy when every one of them is still warming (a cold worker serves better
        than none)."""
        healthy = [w for w in self.healthy() if w.url not in excluding]
        warm = [w for w in healthy if not w.warming]
        return warm or healthy

    def reachable(self) -> list[Worker]:
        """Routed to or draining: the workers that may run requests now."""
        return [w for w in self._workers.values() if w.healthy or w.draining]

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_worker_url(url))

    def add(self, info: WorkerInfo, *, join: bool = False) -> Worker:
        """Register a discovered worker and start following its events; ``join``: it
        joins a running router (the admin API), so it is warmed first."""
        if info.url in self._workers:
            raise WorkerExistsError(f"worker {info.url} is already registered")
        if self.reference is not None:
            check_compatible(info, self.reference)
        else:
            self.reference = info
        # Registered while draining: known (its running requests may be aborted through
        # the router) but not routed to until its /health answers 200.
        draining = info.server_info.get("draining") is True
        worker = Worker(info, healthy=not draining, draining=draining)
        if self._live_costs:  # what discovery saw, until the first probe
            worker.live_costs = worker_cost_snapshot(info.server_info, None)
        self._workers[info.url] = worker
        self._start_events(worker)
        logger.info("worker %s added%s: model %r, page size %d, KV events %s", info.url,
                    " as draining" if draining else "", info.model, info.page_size,
                    info.events.endpoint if info.events else "none")
        if join and worker.healthy:
            self._begin_warm(worker)
        return worker

    async def add_url(self, url: str) -> Worker:
        url = normalize_worker_url(url)
        async with self._lock:
            if url in self._workers:
                raise WorkerExistsError(f"worker {url} is already registered")
            info = await fetch_worker_info(self._client, url)
            return self.add(info, join=True)

    async def remove(self, url: str) -> None:
        url = normalize_worker_url(url)
        async with self._lock:
            worker = self._workers.pop(url, None)
            if worker is None:
                raise UnknownWorkerError(f"worker {url} is not registered")
            await self._stop_events(worker)
            self._index.remove_worker(url)
            if self._tier_costs is not None:
                self._tier_costs.pop(url, None)
            logger.info("worker %s removed", url)

    # -- health

    def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name="worker health"
            )

    async def stop(self) -> None:
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for warm in list(self._warm_tasks):
            warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm
        for worker in self._workers.values():
            await self._stop_events(worker)
        if self._own_zmq:
            self._zmq.term()

    async def mark_down(self, url: str, reason: str) -> None:
        """Out of routing now; its index entries dropped."""
        worker = self._workers.get(url)
        if worker is None or not (worker.healthy or worker.draining):
            return
        was = worker.state
        worker.healthy = worker.draining = worker.warming = False
        await self._stop_events(worker)
        self._index.remove_worker(url)
        if was == "draining":
            logger.info("worker %s is gone after draining (%s): routed to again when it "
                        "answers /health", redact(url), reason)
        else:
            logger.warning("worker %s is down (%s): routed around until it answers /health",
                           redact(url), reason)

    async def mark_draining(self, url: str, reason: str) -> None:
        """Out of routing now as draining, not as failed: no streak, its subscriber kept
        (what it drains to L3 is announced there). Logged once per drain."""
        worker = self._workers.get(url)
        if worker is None or worker.draining:
            return
        was_up = worker.healthy
        worker.healthy, worker.draining, worker.warming = False, True, False
        worker.health.reset()
        if was_up:
            logger.warning("worker %s is draining (%s): no new requests go there, its "
                           "running ones finish; routed to again when /health answers 200",
                           redact(url), reason)
        else:  # down, and now answering as draining: still out, now known why
            logger.info("worker %s answers again, as draining (%s): kept out of routing",
                        redact(url), reason)

    async def connection_failed(self, url: str, error: BaseException) -> None:
        """A proxied request to the worker failed before its answer (refused, timed out,
        dropped): heard as its kind of signal."""
        await self.hear(url, signal_of_error(error), type(error).__name__)

    async def answered(self, url: str, status: int) -> None:
        """The worker answered a proxied request with ``status`` (a 5xx is a failure)."""
        await self.hear(url, signal_of_status(status), f"answered {status}")

    async def hear(self, url: str, signal: Signal, detail: str) -> None:
        """What a probe or a proxied request said of a worker in routing; it leaves
        routing as ``health.py`` says. A worker out of routing comes back through its
        probes only."""
        worker = self._workers.get(url)
        if worker is None or not worker.healthy:
            return
        health = worker.health
        was_slow = health.slow
        verdict = health.hear(signal)
        if verdict is Verdict.EJECT:
            streak = "" if signal is Signal.REFUSED else f", {health.failures} in a row"
            await self.mark_down(url, f"{detail}{streak}")
        elif verdict is Verdict.HUNG:
            if any(other.healthy for other in self._workers.values() if other is not worker):
                await self.mark_down(url, f"{detail}; no answer for {HUNG_AFTER_S:.0f} s")
            elif not health.kept_hung:
                health.kept_hung = True
                logger.warning("worker %s has not answered for %.0f s, but it is the last "
                               "healthy one: kept in routing", redact(url), HUNG_AFTER_S)
        elif signal is Signal.TIMED_OUT and not was_slow:
            logger.warning("worker %s is slow (%s): kept in routing (a timeout is no "
                           "failure)", redact(url), detail)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for w in list(self._workers.values())))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.probe_all()

    async def _probe(self, worker: Worker) -> None:
        draining = False
        try:
            response = await self._client.get(f"{worker.url}/health",
                                              timeout=self._probe_timeout_s)
            status = response.status_code
            draining = is_draining_health(response)
            signal = Signal.ANSWERED if status == 200 else Signal.FAILED
            detail = f"/health {status}"
        except httpx.HTTPError as error:
            signal, detail = signal_of_error(error), f"/health: {type(error).__name__}"
        if self._workers.get(worker.url) is not worker:
            return  # removed while probing
        if draining:
            await self.mark_draining(worker.url, "/health answered 503 draining")
        elif worker.healthy:
            await self.hear(worker.url, signal, detail)
        elif signal is Signal.ANSWERED:
            await self._bring_back(worker)
        elif worker.draining and signal is Signal.REFUSED:
            # It exited. Other answers (an error, a timeout) while it drains are its
            # shutting down, and no failure: it stays draining.
            await self.mark_down(worker.url, detail)
        measuring = self._tier_costs is not None or self._live_costs
        if measuring and worker.healthy and signal is Signal.ANSWERED:
            await self._measure_costs(worker)

    async def _measure_costs(self, worker: Worker) -> None:
        """Refresh ``worker``'s measured tier costs and live cost model; on any failure
        keep the last ones."""
        try:
            info = await self._client.get(f"{worker.url}/get_server_info",
                                          timeout=self._probe_timeout_s)
            metrics = await self._client.get(f"{worker.url}/metrics",
                                             timeout=self._probe_timeout_s)
            body = info.json() if info.status_code == 200 else {}
            # Read once for every figure taken from it.
            samples = prometheus_samples(metrics.text) if metrics.status_code == 200 else None
            if isinstance(body, dict) and self._workers.get(worker.url) is worker:
                if self._tier_costs is not None:
                    self._tier_costs[worker.url] = measured_tier_costs(body, samples)
                if self._live_costs:
                    worker.live_costs = worker_cost_snapshot(body, samples)
                    worker.cache_usage = cache_usage(samples)
        except (httpx.HTTPError, ValueError) as error:
            logger.debug("worker %s: tier costs not refreshed: %s", worker.url, error)

    async def _bring_back(self, worker: Worker) -> None:
        """A worker answering again: rediscover it (a restart may have moved its event
        endpoint or changed it), then follow its events from the replay buffer."""
        try:
            info = await fetch_worker_info(self._client, worker.url)
            assert self.reference is not None  # set by the first add
            check_compatible(info, self.reference)
        except WorkerError as error:
            logger.error("worker %s answers /health but stays out of routing: %s",
                         worker.url, error)
            return
        if self._workers.get(worker.url) is not worker or worker.healthy:
            return  # removed, or brought back by another probe, while rediscovering
        if info.server_info.get("draining") is True:
            # Its /health said 200 a moment before the drain began: it takes no requests.
            await self.mark_draining(worker.url, "/get_server_info says draining")
            return
        if worker.draining:
            # A new process at the same URL (or a drain called off): its caches are not
            # the ones indexed. Resync from its events as after a restart.
            await self._stop_events(worker)
            self._index.remove_worker(worker.url)
            if self._workers.get(worker.url) is not worker or worker.healthy:
                return
        worker.info = info
        worker.healthy, worker.draining = True, False
        worker.health.reset()
        self._start_events(worker)
        logger.info("worker %s is back: resyncing its index from its KV events", worker.url)
        self._begin_warm(worker)

    # -- warm on join

    def _begin_warm(self, worker: Worker) -> None:
        """Warm a joining worker; routable (``routable``) once its warm is over."""
        warmer = self.warmer
        if warmer is None or not warmer.enabled:
            return
        worker.warming = True
        worker.warm_generation += 1
        task = asyncio.get_running_loop().create_task(
            self._warm(worker, warmer, worker.warm_generation),
            name=f"warm {redact(worker.url)}")
        self._warm_tasks.add(task)
        task.add_done_callback(self._warm_tasks.discard)

    async def _warm(self, worker: Worker, warmer: JoinWarmer, generation: int) -> None:
        try:
            await warmer.warm(worker.url, worker.info.server_info)
        finally:
            # Still the same worker, still warming (not gone down or draining meanwhile),
            # and this still its current warm (not one it came back again after).
            if self._workers.get(worker.url) is worker and worker.warming \
                    and worker.warm_generation == generation:
                worker.warming = False
                logger.info("worker %s is warm: routed to", redact(worker.url))

    # -- events

    def _start_events(self, worker: Worker) -> None:
        if worker.info.events is None:
            return
        worker.subscriber = EventSubscriber(worker.url, worker.info.events, self._index,
                                            self._zmq, counts=worker.event_counts)
        worker.subscriber.start()

    async def _stop_events(self, worker: Worker) -> None:
        subscriber, worker.subscriber = worker.subscriber, None
        if subscriber is not None:
            await subscriber.stop()
