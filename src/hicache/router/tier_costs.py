"""What a page costs a worker from each tier, measured (``--tier-costs measured``).

A page the worker must compute costs ``page_size`` tokens of prefill. One it holds
on its host costs the L2->L1 copy; one in the shared pool costs the L3 read into
the host, then that copy. ``TierCosts`` holds the two ratios (recomputing = 1.0),
each clamped to [0, 1]: a tier slower than recomputing is worth nothing to the
router, since the worker would recompute instead.

The figures come from what the worker reports, /get_server_info's
``internal_states`` first and its /metrics text second (same numbers, Prometheus
names). Each figure is read from the worker's live cost model first
(``engine/cost_model.py``: fit online from its recent steps, loads and reads, so it
follows a tier that slows down now, which a lifetime average would hide), then
from the cumulative totals since the worker started:

- prefill seconds per token: the estimate's cold prefill at ``REFERENCE_CONTEXT``
  tokens, ``cost_prefill_seconds_per_token_context_4096``
  (/metrics: ``hicache_cost_prefill_seconds_per_token{context="4096"}``); else
  ``engine_prefill_step_seconds`` / ``engine_num_prefill_step_tokens``
  (``hicache_prefill_step_seconds_total`` / ``hicache_prefill_step_tokens_total``);
- L2->L1 load time per page: one load of ``REFERENCE_PAGES`` pages,
  (``cost_l2_load_latency_seconds`` + ``REFERENCE_PAGES`` *
  ``cost_l2_load_seconds_per_page``) / ``REFERENCE_PAGES`` (``hicache_cost_l2_load_*``);
  else ``cache_load_seconds`` / ``cache_num_loaded_pages``
  (``hicache_l2_load_seconds_total`` / ``hicache_l2_loaded_pages_total``);
- L3 read time per page: the backend's predicted read of ``REFERENCE_PAGES`` pages
  (its latency + their bytes / its bandwidth, as the engine fit them),
  ``cost_l3_read_reference_seconds_backend_<name>`` / ``REFERENCE_PAGES``
  (``hicache_cost_l3_read_reference_seconds{backend="<name>"}``), the slowest backend
  where several report; else ``storage_prefetch_seconds`` /
  ``storage_prefetch_pages_loaded`` (``hicache_l3_prefetch_seconds_total`` /
  ``hicache_l3_prefetch_pages_loaded_total``).

Why a reference context and a reference load: ``TierCosts`` is one pair of ratios
per worker, refreshed at each health probe and read by the policy at every
decision; the ratio of a load to recomputing changes with the prompt's length
(attention makes a long prompt's tokens dearer) and with the load's size (its
latency spreads over its pages), so the ratios are taken at one typical point,
the middle of the prompt lengths the engine reports, and the 64-page load it
reports.

Fallback, figure by figure: an estimate unknown (the engine has no key for it
until it has enough samples; /metrics no series) gives way to the totals; totals
with too few samples behind them (``MIN_PAGES`` pages, or ``MIN_PREFILL_PAGES``
pages' worth of prefill), or not reported at all, leave the default in their
place: without a prefill figure both costs are ``TierCosts()``'s defaults
(nothing to compare against); without an L2->L1 time the host cost is the
default, and the L3 cost is the L3 read plus that host cost; without an L3 read
time the L3 cost is the default.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from hicache.router.metrics_text import MetricsTextError
from hicache.router.metrics_text import samples as metric_samples
from hicache.router.types import TierCosts

logger = logging.getLogger(__name__)

# Pages read (or loaded) before a per-page time from the totals is trusted.
MIN_PAGES: Final = 8
# Pages' worth of prompt tokens computed before the totals' prefill rate is trusted.
MIN_PREFILL_PAGES: Final = 8
# The cold prompt length (tokens) the prefill estimate is read at: one of those the
# engine reports (``engine.cost_model.REFERENCE_CONTEXTS``), the middle one.
REFERENCE_CONTEXT: Final = 4096
# The load the host and L3 estimates are read at (pages): the engine's reference
# load (``engine.cost_model.REFERENCE_PAGES``), whose L3 read it predicts.
REFERENCE_PAGES: Final = 64

_METRICS_PREFIX: Final = "hicache_"

# figure -> ((counter key, seconds key) in internal_states, the same in /metrics)
_PREFILL: Final = (("engine_num_prefill_step_tokens", "engine_prefill_step_seconds"),
                   ("hicache_prefill_step_tokens_total", "hicache_prefill_step_seconds_total"))
_L3_READ: Final = (("storage_prefetch_pages_loaded", "storage_prefetch_seconds"),
                   ("hicache_l3_prefetch_pages_loaded_total", "hicache_l3_prefetch_seconds_total"))
_HOST_LOAD: Final = (("cache_num_loaded_pages", "cache_load_seconds"),
                     ("hicache_l2_loaded_pages_total", "hicache_l2_load_seconds_total"))

# The live estimates' keys in internal_states; /metrics names them with the prefix,
# a label's value read as the key's tail (see ``prometheus_samples``).
_PREFILL_PER_TOKEN: Final = f"cost_prefill_seconds_per_token_context_{REFERENCE_CONTEXT}"
_L2_LATENCY: Final = "cost_l2_load_latency_seconds"
_L2_PER_PAGE: Final = "cost_l2_load_seconds_per_page"
_L3_REFERENCE: Final = "cost_l3_read_reference_seconds_backend_"


@dataclass(frozen=True)
class WorkerFigures:
    """What a worker measured; None where it did not (or not enough yet)."""

    page_size: int | None = None
    prefill_tokens_per_s: float | None = None
    l3_read_s_per_page: float | None = None
    host_load_s_per_page: float | None = None


def worker_figures(server_info: Mapping[str, Any], metrics_text: MetricsInput) -> WorkerFigures:
    """The figures from a worker's /get_server_info JSON and /metrics text."""
    counters: Mapping[str, Any] = {}
    states = server_info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        counters = states[0]
    samples = samples_of(metrics_text)
    page_size = server_info.get("page_size")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        page_size = None
    # Estimates are read under their internal_states names from both sources.
    sources = (counters, {k.removeprefix(_METRICS_PREFIX): v for k, v in samples.items()})

    def pair(keys: tuple[tuple[str, str], tuple[str, str]]) -> tuple[float, float] | None:
        for source, (count_key, seconds_key) in zip((counters, samples), keys, strict=True):
            count = finite_number(source.get(count_key))
            seconds = finite_number(source.get(seconds_key))
            if count is not None and seconds is not None and count > 0 and seconds > 0:
                return count, seconds
        return None

    prefill_rate = _first(_prefill_rate_estimate(source) for source in sources)
    if prefill_rate is None:
        prefill = pair(_PREFILL)
        enough_tokens = MIN_PREFILL_PAGES * (page_size or 0)
        if prefill is not None and page_size is not None and prefill[0] >= enough_tokens:
            prefill_rate = prefill[0] / prefill[1]
    l3_read = _first(_l3_read_estimate(source) for source in sources)
    host_load = _first(_host_load_estimate(source) for source in sources)
    return WorkerFigures(
        page_size=page_size, prefill_tokens_per_s=prefill_rate,
        l3_read_s_per_page=l3_read if l3_read is not None else _per_page(pair(_L3_READ)),
        host_load_s_per_page=(host_load if host_load is not None
                              else _per_page(pair(_HOST_LOAD))),
    )


def _prefill_rate_estimate(source: Mapping[str, Any]) -> float | None:
    per_token = finite_number(source.get(_PREFILL_PER_TOKEN))
    return 1.0 / per_token if per_token is not None and per_token > 0 else None


def _host_load_estimate(source: Mapping[str, Any]) -> float | None:
    latency = finite_number(source.get(_L2_LATENCY))
    per_page = finite_number(source.get(_L2_PER_PAGE))
    if latency is None or per_page is None or latency < 0 or per_page < 0:
        return None
    return (latency + REFERENCE_PAGES * per_page) / REFERENCE_PAGES


def _l3_read_estimate(source: Mapping[str, Any]) -> float | None:
    """The slowest attached backend's predicted reference read, per page: the router
    cannot tell which backend a page would come from."""
    reads = [finite_number(value) for key, value in source.items() if key.startswith(_L3_REFERENCE)]
    known = [seconds for seconds in reads if seconds is not None and seconds >= 0]
    return max(known) / REFERENCE_PAGES if known else None


def _first(values: Iterable[float | None]) -> float | None:
    return next((value for value in values if value is not None), None)


def tier_costs_from(figures: WorkerFigures) -> TierCosts:
    """The cost ratios the figures give; see the module docstring for the fallback."""
    default = TierCosts()
    if figures.prefill_tokens_per_s is None or figures.page_size is None:
        return default
    recompute_s = figures.page_size / figures.prefill_tokens_per_s
    host = default.host
    if figures.host_load_s_per_page is not None:
        host = _unit(figures.host_load_s_per_page / recompute_s)
    external = default.external
    if figures.l3_read_s_per_page is not None:
        external = _unit(figures.l3_read_s_per_page / recompute_s + host)
    return TierCosts(host=host, external=external)


def measured_tier_costs(server_info: Mapping[str, Any], metrics_text: MetricsInput) -> TierCosts:
    """A worker's ``TierCosts`` from its /get_server_info JSON and /metrics text
    (either may lack the figures: the defaults stand in, figure by figure)."""
    return tier_costs_from(worker_figures(server_info, metrics_text))


def _per_page(pair: tuple[float, float] | None) -> float | None:
    if pair is None or pair[0] < MIN_PAGES:
        return None
    return pair[1] / pair[0]


def finite_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


# A worker's /metrics: its text, or the samples already read from it (``prometheus_samples``:
# a probe reads the text once for all its figures), or None where there is none.
MetricsInput = str | Mapping[str, float] | None


def samples_of(metrics: MetricsInput) -> Mapping[str, float]:
    """The samples of ``metrics`` (``MetricsInput``); empty where there is none."""
    if isinstance(metrics, str):
        return prometheus_samples(metrics) if metrics else {}
    return {} if metrics is None else metrics


def prometheus_samples(text: str) -> dict[str, float]:
    """Samples by name (what the figures need): unlabelled ones under their name, those
    with one label under ``<name>_<label>_<value>``, the engine's key for a labelled
    cost series (``server.metrics``); a malformed text gives what parsed before the
    fault."""
    out: dict[str, float] = {}
    try:
        for name, labels, number in metric_samples(text):
            if not labels:
                out[name] = number
            elif len(labels) == 1:
                ((label, value),) = labels.items()
                out[f"{name}_{label}_{value}"] = number
    except MetricsTextError as error:
        # The figures it lacked fall back to the defaults (documented above).
        logger.debug("a worker's /metrics text did not parse: %s", error)
    return out
