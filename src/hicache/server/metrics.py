"""GET /metrics: the engine's counters and gauges, plus latency histograms, as Prometheus text.

The engine keeps plain numbers (``EngineProtocol.metrics()``); they are read at
scrape time by a collector and named here. Keys the table below does not know
are still exported (``hicache_<key>``, a counter when the key counts
something, ``num_``, else a gauge), so a new engine number shows up without a
server change. Time to first token and end-to-end latency are observed by the
server from each finished request (``GenerateOutput.ttft_s`` / ``latency_s``), and
so is each load-or-recompute choice (``GenerateOutput.reuse``):
``hicache_reuse_decisions_total`` by ``decision``, and the histogram
``hicache_reuse_prediction_ratio`` of actual over predicted time to the first token.

L3 failures form one family, ``hicache_l3_failures_total``, labelled by
``reason`` and ``source``: ``backend`` for what the store detected, counted per
page (``corrupt``, ``missing``, ``no_space`` ...: ``StorageStats.failures``),
``controller`` for the L3 calls the cache gave up on, counted per call
(``breaker_open``, ``get_raised``, ``timeout`` ...: ``StorageMetrics.failures``).
The same reason may come from both (a store's own timeout, a call's deadline).
Under tensor parallelism each rank has its own store: the L3 counters and failures
are the sums over the ranks (gathered by the engine); the bandwidth gauges and the
prefetch allowance are rank 0's.

The live cost model (``engine/cost_model.py``, rank 0's) is exported as gauges
named ``hicache_cost_*``: the predicted cold prefill seconds per token labelled by
``context`` (the prompt length), the host->device load's latency and seconds per
page, and each attached L3 backend's read latency and bandwidth labelled by
``backend``; an estimate still unknown (too few samples) has no series.

Each tenant's cached bytes per tier are ``hicache_tenant_bytes{tier,tenant}``, with a
bounded label set (``tenant_metrics``).

The warm's calls are counted by the server (``hicache_warm_requests_total``,
``hicache_warm_tokens_total``, ``hicache_warm_items_total{outcome}``); the cache hints'
series come from the engine's hint status (``hint_metrics``).

Each server owns its registry: several apps in one process (tests) never
share or clash on series.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.engine.api import EngineProtocol, GenerateOutput
from hicache.server.hint_metrics import HintCollector
from hicache.server.tenant_metrics import KEY_PREFIX as TENANT_KEY_PREFIX
from hicache.server.tenant_metrics import tenant_bytes_family

PREFIX = "hicache_"

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
# Actual over predicted time of a load-or-recompute choice (1: exact).
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


@dataclass(frozen=True)
class Series:
    name: str  # without the prefix; counters without "_total" (the client adds it)
    counter: bool
    help: str
    labels: tuple[tuple[str, str], ...] = ()


def _counter(name: str, text: str, *labels: tuple[str, str]) -> Series:
    return Series(name, True, text, labels)


def _gauge(name: str, text: str) -> Series:
    return Series(name, False, text)


_CACHED = "prompt tokens whose KV was reused, by the tier it came from"
_EVICTED = "pages evicted from the cache, by tier"
_ABORTED = ("requests aborted, by the phase they were in: waiting (queued, nothing computed), "
            "prefill, decode")

# engine.metrics() key -> series.
SERIES: dict[str, Series] = {
    "engine_num_requests": _counter("requests", "requests the engine accepted"),
    "engine_num_finished": _counter("requests_finished", "requests that ran to the end"),
    "engine_num_aborted": _counter("requests_aborted", "requests aborted (client gone, failure)"),
    "engine_num_aborted_waiting": _counter(
        "requests_aborted_by_phase", _ABORTED, ("phase", "waiting")
    ),
    "engine_num_aborted_prefill": _counter(
        "requests_aborted_by_phase", _ABORTED, ("phase", "prefill")
    ),
    "engine_num_aborted_decode": _counter(
        "requests_aborted_by_phase", _ABORTED, ("phase", "decode")
    ),
    "engine_num_prompt_tokens": _counter("prompt_tokens", "prompt tokens of accepted requests"),
    "engine_num_generated_tokens": _counter("generation_tokens", "tokens generated"),
    "engine_num_cached_device_tokens": _counter("cached_tokens", _CACHED, ("source", "device")),
    "engine_num_cached_host_tokens": _counter("cached_tokens", _CACHED, ("source", "host")),
    "engine_num_cached_storage_tokens": _counter("cached_tokens", _CACHED, ("source", "storage")),
    "engine_num_retractions": _counter("retractions", "running requests sent back to wait"),
    "engine_num_steps": _counter("scheduler_steps", "model forward steps"),
    "engine_num_prefill_step_tokens": _counter(
        "prefill_step_tokens", "prompt tokens computed, in the steps that computed any"
    ),
    "engine_prefill_step_seconds": _counter(
        "prefill_step_seconds", "wall time of the steps that computed prompt tokens"
    ),
    "engine_running_requests": _gauge("running_requests", "requests prefilling or decoding"),
    "engine_waiting_requests": _gauge("waiting_requests", "requests waiting for admission"),
    "cache_num_loaded_pages": _counter("l2_loaded_pages", "host (L2) pages loaded to the device"),
    "cache_load_seconds": _counter(
        "l2_load_seconds", "time the host (L2) to device page copies took"
    ),
    "cache_num_backed_up_pages": _counter("l2_backup_pages", "device pages copied to host (L2)"),
    "cache_num_backup_skipped_pages": _counter(
        "l2_backup_skipped_pages", "device pages not copied to host: no room in L2"
    ),
    "cache_num_backup_late_pages": _counter(
        "l2_backup_late_pages",
        "skipped device pages copied to host later, once L2 had room again",
    ),
    "cache_num_device_evicted_pages": _counter("evicted_pages", _EVICTED, ("tier", "device")),
    "cache_num_host_evicted_pages": _counter("evicted_pages", _EVICTED, ("tier", "host")),
    "device_pool_pages": _gauge("device_pool_pages", "pages of the device (L1) KV pool"),
    "device_pool_used_pages": _gauge("device_pool_used_pages", "device pages in use or cached"),
    "host_pool_pages": _gauge("host_pool_pages", "pages of the host (L2) KV pool"),
    "host_pool_used_pages": _gauge("host_pool_used_pages", "host pages in use or cached"),
    "host_pool_faulted_pages": _gauge(
        "host_pool_faulted_pages", "host (L2) pages whose memory is faulted in (the rest is "
        "faulted in while the engine is idle, or on first use)"
    ),
    "host_pool_usage": _gauge("host_pool_usage", "fraction of the host (L2) pool in use"),
    "host_core_pages": _gauge(
        "host_core_pages", "host (L2) pages in its core set (--hicache-core-fraction): "
        "evicted only after every other page"
    ),
    "memory_auto_sized": _gauge(
        "memory_auto_sized", "1 when a KV pool was sized from the memory the machine could "
        "spare (no size flag given), 0 when both came from flags"
    ),
    "memory_device_pool_auto": _gauge(
        "memory_device_pool_auto", "1 when the device (L1) pool was sized from free memory"
    ),
    "memory_host_pool_auto": _gauge(
        "memory_host_pool_auto", "1 when the host (L2) pool was sized from free memory"
    ),
    "memory_device_pool_in_host_memory": _gauge(
        "memory_device_pool_in_host_memory", "1 when the device pool is host memory (CPU)"
    ),
    "memory_device_pool_bytes": _gauge(
        "memory_device_pool_bytes", "bytes of the device (L1) KV pool"
    ),
    "memory_device_pool_tokens": _gauge(
        "memory_device_pool_tokens", "tokens the device (L1) KV pool holds"
    ),
    "memory_host_pool_bytes": _gauge("memory_host_pool_bytes", "bytes of the host (L2) KV pool"),
    "memory_available_bytes": _gauge(
        "memory_available_bytes", "memory available when the pools were sized (the least of "
        "MemAvailable, cgroup headroom and HICACHE_AVAILABLE_MEMORY)"
    ),
    "memory_resident_at_sizing_bytes": _gauge(
        "memory_resident_at_sizing_bytes", "the engine process's resident memory when the "
        "pools were sized (weights, libraries, interpreter)"
    ),
    "memory_weights_bytes": _gauge("memory_weights_bytes", "bytes of the model's parameters"),
    "memory_reserve_bytes": _gauge(
        "memory_reserve_bytes", "host memory kept for what the engine allocates past its pools"
    ),
    "memory_announced_bytes": _gauge(
        "memory_announced_bytes", "host memory the engine process announced it stays within: "
        "resident at sizing + reserve + the pools in host memory"
    ),
    "memory_resident_bytes": _gauge(
        "memory_resident_bytes", "the engine process's resident memory now"
    ),
    "storage_attached": _gauge("l3_attached", "1 when an L3 storage backend is attached"),
    "storage_prefetch_queries": _counter("l3_prefetch_queries", "L3 prefetch lookups"),
    "storage_prefetch_pages_found": _counter("l3_prefetch_pages_found", "pages found in L3"),
    "storage_prefetch_pages_loaded": _counter(
        "l3_prefetch_pages_loaded", "pages read from L3 into host memory"
    ),
    "storage_prefetch_seconds": _counter("l3_prefetch_seconds", "time spent reading L3 pages"),
    "storage_backup_pages_stored": _counter("l3_backup_pages_stored", "pages written to L3"),
    "storage_backup_pages_existing": _counter(
        "l3_backup_pages_existing", "pages L3 already had when backed up"
    ),
    "storage_backup_pages_failed": _counter("l3_backup_pages_failed", "L3 page writes that failed"),
    "storage_backup_seconds": _counter("l3_backup_seconds", "time spent writing L3 pages"),
    "storage_pin_pages": _counter("l3_pin_pages", "pages pinned in L3"),
    "storage_unpin_pages": _counter("l3_unpin_pages", "pages whose L3 pin was removed"),
    "storage_pin_pages_failed": _counter(
        "l3_pin_pages_failed", "pages an L3 pin or unpin did not reach"
    ),
    "storage_prefetch_gbps": _gauge("l3_prefetch_gbps", "mean L3 read bandwidth, GB/s"),
    "storage_backup_gbps": _gauge("l3_backup_gbps", "mean L3 write bandwidth, GB/s"),
    "storage_stalled_calls": _gauge(
        "l3_stalled_calls", "L3 calls past their deadline that have not returned yet"
    ),
    "storage_stalled_host_pages": _gauge(
        "l3_stalled_host_pages", "host pages reserved until stalled L3 calls return"
    ),
    "cost_prefill_samples": _gauge(
        "cost_prefill_samples", "forward steps the prefill cost estimate was fit from"
    ),
    "cost_prefill_coef_step_seconds": _gauge(
        "cost_prefill_step_seconds", "prefill cost model: fixed seconds of a step"
    ),
    "cost_prefill_coef_seconds_per_token": _gauge(
        "cost_prefill_token_seconds", "prefill cost model: seconds per prompt token"
    ),
    "cost_prefill_coef_seconds_per_pair": _gauge(
        "cost_prefill_attention_pair_seconds",
        "prefill cost model: seconds per (query, key) pair attended",
    ),
    "cost_prefill_coef_seconds_per_decode_row": _gauge(
        "cost_prefill_decode_row_seconds",
        "prefill cost model: seconds a decoding request adds to a prefill step",
    ),
    "cost_l2_load_samples": _gauge(
        "cost_l2_load_samples", "host (L2) to device loads the load cost estimate was fit from"
    ),
    "cost_l2_load_latency_seconds": _gauge(
        "cost_l2_load_latency_seconds", "host (L2) to device load: fixed seconds per load"
    ),
    "cost_l2_load_seconds_per_page": _gauge(
        "cost_l2_load_seconds_per_page", "host (L2) to device load: seconds per page"
    ),
    "cost_l2_load_reference_seconds": _gauge(
        "cost_l2_load_reference_seconds", "predicted seconds of a host to device load of 64 pages"
    ),
    "storage_prefetch_timeout_per_ki_token_s": _gauge(
        "l3_prefetch_timeout_per_ki_token_seconds",
        "seconds a timeout-policy prefetch may wait per 1024 tokens, as in force "
        "(the configured number, or under auto what the observed L3 reads call for)",
    ),
}
# Engine numbers replaced by a series computed here (the hit rate over every tier).
_SKIPPED = frozenset({"cache_hit_rate"})
# engine.metrics() key prefix -> the source label of the L3 failure family.
_FAILURE_SOURCES = {"storage_failures_": "controller", "storage_backend_failures_": "backend"}
_FAILURES_HELP = (
    "L3 failures and misses by reason; source=backend: pages the store failed or dropped, "
    "source=controller: L3 calls the cache gave up on"
)
_CACHED_KEYS = {
    "device": "engine_num_cached_device_tokens",
    "host": "engine_num_cached_host_tokens",
    "storage": "engine_num_cached_storage_tokens",
}


def _fallback(key: str) -> Series:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    if "num_" in name:
        return _counter(name.replace("num_", ""), f"engine metric {key}")
    return _gauge(name, f"engine metric {key}")


# engine.metrics() cost keys whose tail is a label: (key prefix, series name, label, help).
_COST_LABELLED = (
    ("cost_prefill_seconds_per_token_context_", "cost_prefill_seconds_per_token", "context",
     "predicted seconds per token to prefill a cold prompt of this many tokens "
     "(live cost model)"),
    ("cost_l3_read_latency_seconds_backend_", "cost_l3_read_latency_seconds", "backend",
     "L3 read latency per call, fit from this backend's prefetch reads"),
    ("cost_l3_read_bandwidth_bytes_per_second_backend_",
     "cost_l3_read_bandwidth_bytes_per_second", "backend",
     "L3 read bandwidth past the latency, fit from this backend's prefetch reads"),
    ("cost_l3_read_reference_seconds_backend_", "cost_l3_read_reference_seconds", "backend",
     "predicted seconds of one L3 read of 64 pages"),
    ("cost_l3_read_samples_backend_", "cost_l3_read_samples", "backend",
     "L3 reads the cost model's latency and bandwidth were fit from"),
)


def _cost_series(key: str) -> Series | None:
    """The labelled cost-model series for an engine key, or None for other keys."""
    for prefix, name, label, text in _COST_LABELLED:
        if key.startswith(prefix):
            return Series(name, False, text, ((label, key.removeprefix(prefix)),))
    return None


def _failure_series(key: str) -> Series | None:
    """The L3 failure family's series for an engine key, or None for other keys."""
    for prefix, source in _FAILURE_SOURCES.items():
        if key.startswith(prefix):
            reason = key.removeprefix(prefix)
            return _counter("l3_failures", _FAILURES_HELP, ("reason", reason), ("source", source))
    return None


class EngineCollector(Collector):
    """Reads ``engine.metrics()`` at each scrape and names the numbers."""

    def __init__(self, engine: EngineProtocol) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # series appear and disappear with L2/L3; nothing fixed to announce

    def collect(self) -> Iterator[Metric]:
        values = self.engine.metrics()
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

        def add(series: Series, value: float) -> None:
            family = families.get(series.name)
            if family is None:
                labels = [name for name, _ in series.labels]
                full = PREFIX + series.name
                family = (CounterMetricFamily(full, series.help, labels=labels) if series.counter
                          else GaugeMetricFamily(full, series.help, labels=labels))
                families[series.name] = family
            family.add_metric([value for _, value in series.labels], value)

        for key, value in values.items():
            if key in _SKIPPED or key.startswith(TENANT_KEY_PREFIX):
                continue
            series = _failure_series(key) or _cost_series(key)
            add(series or SERIES.get(key) or _fallback(key), value)

        prompt = values.get("engine_num_prompt_tokens", 0.0)
        cached = sum(values.get(key, 0.0) for key in _CACHED_KEYS.values())
        add(_gauge("cache_hit_rate", "cached prompt tokens / prompt tokens, every tier"),
            cached / prompt if prompt else 0.0)
        pages = values.get("device_pool_pages", 0.0)
        if pages:
            add(_gauge("device_pool_usage", "fraction of the device (L1) pool in use"),
                values.get("device_pool_used_pages", 0.0) / pages)
        yield from families.values()
        yield tenant_bytes_family(values)


class ServerMetrics:
    """The server's Prometheus registry: engine numbers and request latency histograms."""

    def __init__(self, engine: EngineProtocol) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "time from arrival to the first token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "time from arrival to the last token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.reuse_decisions = Counter(
            PREFIX + "reuse_decisions", "requests a host or L3 hit offered part of the prompt "
            "to, by what they did: load (all of it), recompute (none), split (the first pages), "
            "unpriced (a cost not known yet: loaded)",
            ["decision"], registry=self.registry,
        )
        self.reuse_prediction = Histogram(
            PREFIX + "reuse_prediction_ratio", "actual over predicted time from admission to "
            "the first token of a request whose load-or-recompute choice was priced",
            ["decision"], buckets=PREDICTION_RATIO_BUCKETS, registry=self.registry,
        )
        self.warm_requests = Counter(
            PREFIX + "warm_requests", "POST /hicache/warm calls that ran (a 400 or 409 is not "
            "counted)", registry=self.registry,
        )
        self.warm_tokens = Counter(
            PREFIX + "warm_tokens", "tokens the warm calls brought from L3 into the host tier",
            registry=self.registry,
        )
        self.warm_items = Counter(
            PREFIX + "warm_items", "prefixes the warm calls named, by outcome",
            ["outcome"], registry=self.registry,
        )
        self.registry.register(EngineCollector(engine))
        self.registry.register(HintCollector(engine))

    def observe_warm(self, results: list[dict[str, Any]]) -> None:
        """Count one warm call that ran, from its per-item outcomes."""
        self.warm_requests.inc()
        for result in results:
            self.warm_items.labels(str(result["outcome"])).inc()
            self.warm_tokens.inc(int(result["tokens"]))

    def observe(self, output: GenerateOutput) -> None:
        """Record a finished request's latencies and load-or-recompute choice (aborted ones
        are left out)."""
        if not output.finished or output.finish_reason == "abort":
            return
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)
        if output.latency_s is not None:
            self.latency.observe(output.latency_s)
        reuse = output.reuse
        if reuse is not None:
            self.reuse_decisions.labels(reuse.decision).inc()
            if reuse.predicted_s and reuse.actual_s is not None:
                self.reuse_prediction.labels(reuse.decision).observe(
                    reuse.actual_s / reuse.predicted_s
                )

    def render(self) -> bytes:
        return generate_latest(self.registry)
