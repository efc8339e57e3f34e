"""What a page costs a worker from each tier, measured (``--tier-costs measured``).

A page the worker must compute costs ``page_size / prefill tokens per second``.
One it holds on its host costs the L2->L1 copy; one in the shared pool costs
the L3 read into the host, then that copy. ``TierCosts`` holds the two ratios
(recomputing = 1.0), each clamped to [0, 1]: a tier slower than recomputing is
worth nothing to the router, since the worker would recompute instead.

The figures come from what the worker reports, /get_server_info's
``internal_states`` counters first and its /metrics text second (same numbers,
Prometheus names), all cumulative since the worker started:

- prefill rate: ``engine_num_prefill_step_tokens`` / ``engine_prefill_step_seconds``
  (/metrics: ``hicache_prefill_step_tokens_total`` / ``hicache_prefill_step_seconds_total``);
- L3 read time per page: ``storage_prefetch_seconds`` / ``storage_prefetch_pages_loaded``
  (``hicache_l3_prefetch_seconds_total`` / ``hicache_l3_prefetch_pages_loaded_total``);
- L2->L1 load time per page: ``cache_load_seconds`` / ``cache_num_loaded_pages``
  (``hicache_l2_load_seconds_total`` / ``hicache_l2_loaded_pages_total``).

Fallback, figure by figure: a figure with too few samples behind it
(``MIN_PAGES`` pages, or ``MIN_PREFILL_PAGES`` pages' worth of prefill), or not
reported at all, leaves the default in its place: without a prefill rate both
costs are ``TierCosts()``'s defaults (nothing to compare against); without an
L2->L1 time the host cost is the default, and the L3 cost is the L3 read plus
that host cost; without an L3 read time the L3 cost is the default.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from hicache.router.types import TierCosts

logger = logging.getLogger(__name__)

# Pages read (or loaded) before a per-page time is trusted.
MIN_PAGES: Final = 8
# Pages' worth of prompt tokens computed before the prefill rate is trusted.
MIN_PREFILL_PAGES: Final = 8

# figure -> ((counter key, seconds key) in internal_states, the same in /metrics)
_PREFILL: Final = (("engine_num_prefill_step_tokens", "engine_prefill_step_seconds"),
                   ("hicache_prefill_step_tokens_total", "hicache_prefill_step_seconds_total"))
_L3_READ: Final = (("storage_prefetch_pages_loaded", "storage_prefetch_seconds"),
                   ("hicache_l3_prefetch_pages_loaded_total", "hicache_l3_prefetch_seconds_total"))
_HOST_LOAD: Final = (("cache_num_loaded_pages", "cache_load_seconds"),
                     ("hicache_l2_loaded_pages_total", "hicache_l2_load_seconds_total"))


@dataclass(frozen=True)
class WorkerFigures:
    """What a worker measured; None where it did not (or not enough yet)."""

    page_size: int | None = None
    prefill_tokens_per_s: float | None = None
    l3_read_s_per_page: float | None = None
    host_load_s_per_page: float | None = None


def worker_figures(server_info: Mapping[str, Any], metrics_text: str | None) -> WorkerFigures:
    """The figures from a worker's /get_server_info JSON and /metrics text."""
    counters: Mapping[str, Any] = {}
    states = server_info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        counters = states[0]
    samples = _prometheus_samples(metrics_text) if metrics_text else {}
    page_size = server_info.get("page_size")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        page_size = None

    def pair(keys: tuple[tuple[str, str], tuple[str, str]]) -> tuple[float, float] | None:
        for source, (count_key, seconds_key) in zip((counters, samples), keys, strict=True):
            count, seconds = _number(source.get(count_key)), _number(source.get(seconds_key))
            if count is not None and seconds is not None and count > 0 and seconds > 0:
                return count, seconds
        return None

    prefill_rate = None
    prefill = pair(_PREFILL)
    enough_tokens = MIN_PREFILL_PAGES * (page_size or 0)
    if prefill is not None and page_size is not None and prefill[0] >= enough_tokens:
        prefill_rate = prefill[0] / prefill[1]
    return WorkerFigures(
        page_size=page_size, prefill_tokens_per_s=prefill_rate,
        l3_read_s_per_page=_per_page(pair(_L3_READ)),
        host_load_s_per_page=_per_page(pair(_HOST_LOAD)),
    )


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


def measured_tier_costs(server_info: Mapping[str, Any], metrics_text: str | None) -> TierCosts:
    """A worker's ``TierCosts`` from its /get_server_info JSON and /metrics text
    (either may lack the figures: the defaults stand in, figure by figure)."""
    return tier_costs_from(worker_figures(server_info, metrics_text))


def _per_page(pair: tuple[float, float] | None) -> float | None:
    if pair is None or pair[0] < MIN_PAGES:
        return None
    return pair[1] / pair[0]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


def _prometheus_samples(text: str) -> dict[str, float]:
    """Unlabelled samples by name (what the figures need); a malformed text gives
    what parsed before the fault."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.labels:
                    out[sample.name] = sample.value
    except ValueError as error:
        # The figures it lacked fall back to the defaults (documented above).
        logger.debug("a worker's /metrics text did not parse: %s", error)
    return out
