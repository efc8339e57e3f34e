"""/get_server_info's ``cost_model`` block, made from the engine's ``cost_*`` numbers.

Invariant: an estimate still unknown (too few samples) reads None, never a guess;
the block is None from an engine that keeps no cost model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.engine.cost_model import REFERENCE_CONTEXTS, REFERENCE_PAGES

_L3_PREFIX = "cost_l3_read_samples_backend_"
_COEFFICIENTS = ("step_seconds", "seconds_per_token", "seconds_per_pair",
                 "seconds_per_decode_row")


def cost_model_description(counters: Mapping[str, float]) -> dict[str, Any] | None:
    """Each estimate's coefficients, its sample count and its predictions at reference
    points: a cold prefill of 1K/4K/16K tokens, a load of 64 pages from host and from
    each attached L3 backend."""
    if "cost_prefill_samples" not in counters:
        return None
    get = counters.get
    coefficients = {k: get(f"cost_prefill_coef_{k}") for k in _COEFFICIENTS}
    cold: dict[str, float | None] = {}
    for tokens in REFERENCE_CONTEXTS:
        per_token = get(f"cost_prefill_seconds_per_token_context_{tokens}")
        cold[str(tokens)] = per_token * tokens if per_token is not None else None
    l3: dict[str, Any] = {}
    for key in counters:
        if key.startswith(_L3_PREFIX):
            name = key.removeprefix(_L3_PREFIX)
            l3[name] = {
                "samples": int(counters[key]),
                "latency_seconds": get(f"cost_l3_read_latency_seconds_backend_{name}"),
                "bandwidth_bytes_per_second":
                    get(f"cost_l3_read_bandwidth_bytes_per_second_backend_{name}"),
                "reference_read_seconds": get(f"cost_l3_read_reference_seconds_backend_{name}"),
            }
    return {
        "reference_pages": REFERENCE_PAGES,
        "prefill": {
            "samples": int(counters["cost_prefill_samples"]),
            "coefficients": coefficients if coefficients["step_seconds"] is not None else None,
            "cold_prefill_seconds": cold,
        },
        "l2_load": {
            "samples": int(get("cost_l2_load_samples", 0.0)),
            "latency_seconds": get("cost_l2_load_latency_seconds"),
            "seconds_per_page": get("cost_l2_load_seconds_per_page"),
            "reference_load_seconds": get("cost_l2_load_reference_seconds"),
        },
        "l3": l3,
    }
