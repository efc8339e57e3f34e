"""GET /metrics of the router, as Prometheus text.

Observed per routed request: the decision's latency, the chosen worker's
overlap per tier, and (when the shared pool was asked) the two histograms of
Dynamo's shared-cache routing, ``router_shared_cache_hit_rate`` (fraction of the
request's pages the shared pool holds) and ``router_shared_cache_beyond_blocks`` (shared pages
past the chosen worker's device prefix). Read at scrape time from the
registry: each worker's up/down state and load, its event subscriber's
counts (batches, gaps, replays, restarts, malformed), and the index's size.
The proxies count what went wrong on the way: worker failures by stage
(``before_answer``: refused or dropped before a status line, the request retried
elsewhere; ``timeout``: silent past ``--request-timeout``; ``mid_answer``: the
answer broke off), retries, and clients that left before their answer was whole
(``before_answer``: the worker's request was dropped with them; ``answering``:
during a streamed answer), and the requests a draining worker refused (each sent
on to another worker; the draining workers are the ``router_worker_draining``
gauge). Forwarded cache hints are counted by kind and outcome (``router_hints_total``).
Warm-on-join (``warm.py``): ``router_warms_total{outcome}``, the tokens
warmed ``router_warm_tokens_total``, and the ``router_worker_warming`` gauge.
The workers' cost model, as tier_aware and predicted_ttft price it, is checked here:
``router_predicted_ttft_seconds`` (each decision's prediction for its chosen worker),
``router_measured_ttft_seconds`` (the time from sending a streamed request to its first
body byte) and
``router_ttft_prediction_error_seconds`` (measured minus predicted, per streamed request:
positive when the router was optimistic; its buckets are signed, so Prometheus gives it no
``_sum``) with ``router_ttft_prediction_ratio`` (measured over predicted: its mean is the
model's bias whatever the prompts' lengths), all labelled by policy; a request that does not
stream gets a prediction but no measurement (its first byte is its last: TTFT would be
its whole time, ``decisions.py``). ``router_worker_queued_prefill_seconds{worker}`` is
each worker's ledger (``ledger.py``): the predicted prefill still ahead of a request sent
there now, and ``router_worker_pending_prefill_pages{worker}`` the same requests in pages
they compute there (as a policy that counts pages routed them; tier_aware's
``pending_prefill`` load term). A ``worker`` label never carries the credentials of a
worker's URL (``credentials.redact``).
Each router owns its registry, so several in one process (tests) never clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.router.credentials import redact
from hicache.router.types import TIERS, RouteDecision
from hicache.router.warm import JoinWarmer
from hicache.router.workers import Worker


class WorkerSource(Protocol):
    """Where the live gauges read the workers from (a registry, or both PD pools)."""

    def all(self) -> list[Worker]: ...

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DECISION_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PAGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Measured minus predicted: symmetric, so under- and over-prediction read alike.
ERROR_BUCKETS_S = (-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.025, 0.0, 0.025, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
# TierOverlap's field for each tier name, top tier first.
_TIER_FIELDS = dict(zip(TIERS, ("gpu", "host", "external"), strict=True))


class RouterMetrics:
    def __init__(self, workers: WorkerSource, indexed_pages: Callable[[], int],
                 warmer: JoinWarmer | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decision_latency = Histogram(
            "router_decision_latency_seconds", "time to choose a worker (hashing excluded)",
            buckets=DECISION_BUCKETS_S, registry=r,
        )
        self.shared_hit_rate = Histogram(
            "router_shared_cache_hit_rate",
            "fraction of a request's pages found in the shared pool",
            buckets=RATE_BUCKETS, registry=r,
        )
        self.shared_beyond = Histogram(
            "router_shared_cache_beyond_blocks",
            "shared-pool pages past the chosen worker's device overlap",
            buckets=PAGE_BUCKETS, registry=r,
        )
        self.overlap = Histogram(
            "router_overlap_pages",
            "the chosen worker's prefix overlap with the request, in pages, per tier "
            "(a tier counts the tiers above it)",
            ["tier"], buckets=PAGE_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "router_requests", "requests sent to each worker", ["worker"], registry=r,
        )
        self.retries = Counter(
            "router_retries", "requests sent again to another worker after the first one "
            "failed before answering", registry=r,
        )
        self.hints = Counter(
            "router_hints", "cache hints forwarded (POST /hicache/hints), by kind and the "
            "outcome the client got (the best of the workers' for one sent to several)",
            ["kind", "outcome"], registry=r,
        )
        self.unavailable = Counter(
            "router_unavailable", "requests refused with 503: no healthy worker", registry=r,
        )
        self.worker_failures = Counter(
            "router_worker_failures", "requests a worker failed, by stage: before_answer "
            "(refused, or dropped before its status line), timeout (silent past "
            "--request-timeout), mid_answer (the answer broke off)", ["worker", "stage"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "router_client_disconnects", "clients that left before their answer was whole, "
            "by stage: before_answer (the worker's request was dropped with them), "
            "answering (during the answer)", ["stage"], registry=r,
        )
        self.drain_refusals = Counter(
            "router_drain_refusals", "requests a draining worker refused (503 draining), "
            "sent on to another worker", ["worker"], registry=r,
        )
        self.shared_queries = Counter(
            "router_shared_cache_queries", "shared-pool (L3) queries of tier_aware decisions, "
            "by outcome: answered (within the decision's deadline, 20 ms by default), late "
            "(scored from the index alone; the answer is kept for the next decisions), failed "
            "(the pool could not answer)", ["outcome"], registry=r,
        )
        self.predicted_ttft = Histogram(
            "router_predicted_ttft_seconds", "the chosen worker's predicted time to first "
            "token, per decision", ["policy"], buckets=TTFT_BUCKETS_S, registry=r,
        )
        self.measured_ttft = Histogram(
            "router_measured_ttft_seconds", "time from sending a streamed request to a "
            "worker to its answer's first byte", ["policy"], buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.ttft_error = Histogram(
            "router_ttft_prediction_error_seconds", "measured minus predicted time to first "
            "token of a streamed request (positive: slower than predicted)", ["policy"],
            buckets=ERROR_BUCKETS_S, registry=r,
        )
        self.ttft_ratio = Histogram(
            "router_ttft_prediction_ratio", "measured over predicted time to first token of "
            "a streamed request (above 1: slower than predicted)", ["policy"],
            buckets=RATIO_BUCKETS, registry=r,
        )
        r.register(_LiveState(workers, indexed_pages, warmer))

    def sent(self, worker_url: str) -> None:
        """A request went to the worker."""
        self.requests.labels(worker=redact(worker_url)).inc()

    def worker_failed(self, worker_url: str, stage: str) -> None:
        self.worker_failures.labels(worker=redact(worker_url), stage=stage).inc()

    def drain_refused(self, worker_url: str) -> None:
        """A draining worker refused a request; it goes to another worker (a retry)."""
        self.drain_refusals.labels(worker=redact(worker_url)).inc()

    def client_left(self, stage: str) -> None:
        self.client_disconnects.labels(stage=stage).inc()

    def observe_decision(self, decision: RouteDecision, num_pages: int, latency_s: float) -> None:
        self.decision_latency.observe(latency_s)
        chosen = decision.overlaps.get(decision.worker)
        if chosen is not None:
            for tier, attribute in _TIER_FIELDS.items():
                self.overlap.labels(tier=tier).observe(getattr(chosen, attribute))
        if decision.shared_outcome is not None:
            self.shared_queries.labels(outcome=decision.shared_outcome).inc()
        if decision.shared_hits is not None and num_pages > 0:
            self.shared_hit_rate.observe(decision.shared_hits / num_pages)
            self.shared_beyond.observe(decision.shared_beyond)
        if decision.predicted_ttft_s is not None:
            self.predicted_ttft.labels(policy=decision.policy).observe(decision.predicted_ttft_s)

    def observe_first_token(self, decision: RouteDecision, measured_s: float) -> None:
        """A streamed request's first byte came back ``measured_s`` after it was sent."""
        self.measured_ttft.labels(policy=decision.policy).observe(measured_s)
        if decision.predicted_ttft_s is not None:
            self.ttft_error.labels(policy=decision.policy).observe(
                measured_s - decision.predicted_ttft_s)
            if decision.predicted_ttft_s > 0:
                self.ttft_ratio.labels(policy=decision.policy).observe(
                    measured_s / decision.predicted_ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveState(Collector):
    def __init__(self, workers: WorkerSource, indexed_pages: Callable[[], int],
                 warmer: JoinWarmer | None = None) -> None:
        self._workers = workers
        self._indexed_pages = indexed_pages
        self._warmer = warmer

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("router_worker_up", "1 while the worker is routed to",
                               labels=["worker"])
        draining = GaugeMetricFamily("router_worker_draining",
                                     "1 while the worker drains (out of routing, not down)",
                                     labels=["worker"])
        active = GaugeMetricFamily("router_worker_active_requests",
                                   "requests in flight at the worker", labels=["worker"])
        queued = GaugeMetricFamily("router_worker_queued_prefill_seconds",
                                   "predicted prefill seconds the router sent the worker that "
                                   "have not produced a first token yet, less what it worked "
                                   "off since", labels=["worker"])
        pending = GaugeMetricFamily("router_worker_pending_prefill_pages",
                                    "pages of prefill the router sent the worker that have "
                                    "not produced a first token yet", labels=["worker"])
        warming = GaugeMetricFamily("router_worker_warming", "1 while the worker that joined "
                                    "is warmed from L3 (routed to only as a last resort)",
                                    labels=["worker"])
        counters = {
            name: CounterMetricFamily(f"router_kv_event_{name}", text, labels=["worker"])
            for name, text in (
                ("batches", "KV event batches applied to the index"),
                ("gaps", "KV event sequence jumps"),
                ("replays", "replay requests sent"),
                ("replay_failures", "replays without a complete answer"),
                ("restarts", "KV event sequences that went back (worker restarted)"),
                ("malformed", "KV event messages skipped as unreadable"),
            )
        }
        for worker in self._workers.all():
            label = redact(worker.url)
            up.add_metric([label], 1.0 if worker.healthy else 0.0)
            draining.add_metric([label], 1.0 if worker.draining else 0.0)
            active.add_metric([label], worker.active_requests)
            queued.add_metric([label], worker.ledger.queued_s())
            pending.add_metric([label], worker.ledger.pending_pages)
            warming.add_metric([label], 1.0 if worker.warming else 0.0)
            for name, family in counters.items():
                family.add_metric([label], getattr(worker.event_counts, name))
        yield up
        yield draining
        yield active
        yield queued
        yield pending
        yield warming
        yield from counters.values()
        yield GaugeMetricFamily("router_indexed_pages", "pages the index holds",
                                value=self._indexed_pages())
        if self._warmer is not None:
            warms = CounterMetricFamily(
                "router_warms", "warms of joining workers from L3, by outcome: warmed, "
                "timeout, failed, skipped (no L3, no host pool size, nothing recorded)",
                labels=["outcome"])
            for outcome, count in self._warmer.outcomes.items():
                warms.add_metric([outcome], count)
            yield warms
            yield CounterMetricFamily("router_warm_tokens", "prompt tokens joining workers "
                                      "reported warmed into their host tier",
                                      value=self._warmer.tokens)
