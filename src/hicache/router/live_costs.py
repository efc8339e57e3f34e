"""A worker's live cost model as the router reads it, and the costs a decision prices with.

``worker_cost_snapshot`` turns what a worker reports (/get_server_info's
``internal_states`` first, its /metrics text second: the same numbers) into the
``CostSnapshot`` its own load-or-recompute plans use (``engine/reuse_plan.py``):

- prefill: the fit's four coefficients ``cost_prefill_coef_*`` (fixed step seconds,
  seconds per prompt token, per attention pair, per decode row beside the step), so the
  cost grows with the context as the worker's does; the scheduler's
  ``chunked_prefill_size`` splits a long prompt in steps as it does. Before the fit
  exists, the totals' tokens per second (``tier_costs.worker_figures``) stand in as a
  per-token cost alone;
- host -> device load: ``cost_l2_load_latency_seconds`` and ``..._seconds_per_page``,
  else the totals' seconds per page;
- L3 read: the slowest backend's latency and, from its 64-page reference read, its
  seconds per page; else the totals' seconds per page.

``cache_usage`` reads how full the worker's cache is from the same /metrics text: its host
pool's usage, else (no host tier) its device pool's.

``resolve_costs`` fills what one worker has not measured, figure by figure (prefill,
host load, L3 read): the median of the workers that did, else a conservative default,
and says which it used. The defaults price against the prefill rate as the fixed tier
costs do (``TierCosts()``: a host page costs 0.1 of recomputing it, an L3 page 0.5 with
its host load), with ``DEFAULT_SECONDS_PER_TOKEN`` when no worker has a prefill figure
(all are then priced alike, so only the ratios matter to the choice).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from hicache.engine.cost_model import REFERENCE_PAGES
from hicache.engine.reuse_plan import CostSnapshot
from hicache.estimators import PrefillCoefficients
from hicache.router.tier_costs import MetricsInput, finite_number, samples_of, worker_figures
from hicache.router.types import TierCosts

# Seconds a prompt token costs when no worker has measured its prefill.
DEFAULT_SECONDS_PER_TOKEN: Final = 1e-3

# The prefill fit's coefficients: engine key suffix -> /metrics name (server.metrics).
_COEFFICIENTS: Final = {
    "step_seconds": "hicache_cost_prefill_step_seconds",
    "seconds_per_token": "hicache_cost_prefill_token_seconds",
    "seconds_per_pair": "hicache_cost_prefill_attention_pair_seconds",
    "seconds_per_decode_row": "hicache_cost_prefill_decode_row_seconds",
}
_L3_LATENCY: Final = "cost_l3_read_latency_seconds_backend_"
_L3_REFERENCE: Final = "cost_l3_read_reference_seconds_backend_"


def worker_cost_snapshot(server_info: Mapping[str, Any], metrics_text: MetricsInput,
                         ) -> CostSnapshot:
    """The worker's costs; a field is None where it has not measured that yet."""
    states = server_info.get("internal_states")
    counters: Mapping[str, Any] = {}
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        counters = states[0]
    samples = samples_of(metrics_text)
    # Both sources under the engine's names (the labelled series already are).
    unprefixed = {k.removeprefix("hicache_"): v for k, v in samples.items()}
    for key, name in _COEFFICIENTS.items():
        if name in samples:
            unprefixed[f"cost_prefill_coef_{key}"] = samples[name]
    sources = (counters, unprefixed)
    figures = worker_figures(server_info, samples)

    prefill = next((c for c in map(_coefficients, sources) if c is not None), None)
    if prefill is None and figures.prefill_tokens_per_s is not None:
        prefill = PrefillCoefficients(0.0, 1.0 / figures.prefill_tokens_per_s, 0.0, 0.0)
    load = next((p for p in map(_host_load, sources) if p is not None), None)
    if load is None and figures.host_load_s_per_page is not None:
        load = (0.0, figures.host_load_s_per_page)
    read = next((p for p in map(_l3_read, sources) if p is not None), None)
    if read is None and figures.l3_read_s_per_page is not None:
        read = (0.0, figures.l3_read_s_per_page)
    chunk = server_info.get("chunked_prefill_size")
    return CostSnapshot(
        prefill=prefill,
        chunk_tokens=chunk if isinstance(chunk, int) and not isinstance(chunk, bool)
        and chunk > 0 else None,
        load_latency_s=None if load is None else load[0],
        load_seconds_per_page=None if load is None else load[1],
        read_latency_s=None if read is None else read[0],
        read_seconds_per_page=None if read is None else read[1],
    )


def cache_usage(metrics_text: MetricsInput) -> float | None:
    """How full the worker's cache is, 0..1: the host (L2) pool's share in use, else the
    device (L1) pool's; None when its /metrics says neither."""
    samples = samples_of(metrics_text)
    for name in ("hicache_host_pool_usage", "hicache_device_pool_usage"):
        value = finite_number(samples.get(name))
        if value is not None:
            return min(1.0, max(0.0, value))
    return None


def _coefficients(source: Mapping[str, Any]) -> PrefillCoefficients | None:
    values = [finite_number(source.get(f"cost_prefill_coef_{key}")) for key in _COEFFICIENTS]
    if any(v is None or v < 0 for v in values):
        return None
    step, token, pair, row = (float(v) for v in values if v is not None)
    if token <= 0 and pair <= 0 and step <= 0:
        return None  # a fit that prices a prompt at nothing is no measurement
    return PrefillCoefficients(step, token, pair, row)


def _host_load(source: Mapping[str, Any]) -> tuple[float, float] | None:
    latency = finite_number(source.get("cost_l2_load_latency_seconds"))
    per_page = finite_number(source.get("cost_l2_load_seconds_per_page"))
    if latency is None or per_page is None or latency < 0 or per_page < 0:
        return None
    return latency, per_page


def _l3_read(source: Mapping[str, Any]) -> tuple[float, float] | None:
    """The slowest backend's (latency, seconds per page): the router cannot tell which
    backend a page would come from."""
    best: tuple[float, float] | None = None
    for key, value in source.items():
        if not key.startswith(_L3_REFERENCE):
            continue
        reference = finite_number(value)
        latency = finite_number(source.get(_L3_LATENCY + key.removeprefix(_L3_REFERENCE)))
        if reference is None or reference < 0:
            continue
        latency = min(reference, latency) if latency is not None and latency >= 0 else 0.0
        pair = (latency, (reference - latency) / REFERENCE_PAGES)
        if best is None or reference > best[0] + REFERENCE_PAGES * best[1]:
            best = pair
    return best


def resolve_costs(
    own: CostSnapshot | None, others: Sequence[CostSnapshot | None], page_size: int,
) -> tuple[CostSnapshot, tuple[str, ...]]:
    """``own`` with every missing figure filled (the median of ``others``' that have it,
    else the default) and the list of what was filled (``"prefill=median"``, ...)."""
    own = own if own is not None else CostSnapshot(prefill=None, chunk_tokens=None)
    known = [o for o in others if o is not None]
    filled: list[str] = []
    prefill = own.prefill
    if prefill is None:
        fits = [o.prefill for o in known if o.prefill is not None]
        if fits:
            prefill = PrefillCoefficients(*(
                statistics.median(getattr(f, name) for f in fits)
                for name in ("step_seconds", "seconds_per_token", "seconds_per_pair",
                             "seconds_per_decode_row")))
            filled.append("prefill=median")
        else:
            prefill = PrefillCoefficients(0.0, DEFAULT_SECONDS_PER_TOKEN, 0.0, 0.0)
            filled.append("prefill=default")
    # A page's recompute at this prefill rate prices the default tiers.
    page_s = page_size * prefill.seconds_per_token
    default = TierCosts()
    load = _pair(own.load_latency_s, own.load_seconds_per_page,
                 [(o.load_latency_s, o.load_seconds_per_page) for o in known],
                 (0.0, default.host * page_s), "host_load", filled)
    read = _pair(own.read_latency_s, own.read_seconds_per_page,
                 [(o.read_latency_s, o.read_seconds_per_page) for o in known],
                 (0.0, max(0.0, default.external - default.host) * page_s), "l3_read", filled)
    resolved = replace(own, prefill=prefill, load_latency_s=load[0],
                       load_seconds_per_page=load[1], read_latency_s=read[0],
                       read_seconds_per_page=read[1])
    return resolved, tuple(filled)


def _pair(
    latency: float | None, per_page: float | None,
    others: Sequence[tuple[float | None, float | None]], default: tuple[float, float],
    name: str, filled: list[str],
) -> tuple[float, float]:
    if latency is not None and per_page is not None:
        return latency, per_page
    known = [(a, b) for a, b in others if a is not None and b is not None]
    if known:
        filled.append(f"{name}=median")
        return (statistics.median(a for a, _ in known), statistics.median(b for _, b in known))
    filled.append(f"{name}=default")
    return default
