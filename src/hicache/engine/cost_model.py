"""The engine's cost model: its live estimates, fed by the scheduler, and their numbers.

One per scheduler (so one per tensor-parallel rank; the engine reports rank 0's,
as it does the L3 bandwidth gauges: the ranks step in lockstep). It holds:

- ``prefill``: a forward step's seconds from its prompt tokens, the attention
  pairs they compute and the decode rows beside them (``estimators.py`` says why
  that form), fed once per step that computed prompt tokens, on the scheduler
  thread, with the same wall time the ``engine_prefill_step_seconds`` counter sums,
  except, on a GPU, the first step of each kind (``step_kind``): its kernels compile;
- ``l2_load``: a host->device load's seconds from its pages, fed with the loads the
  cache controller timed (``CacheController.take_load_samples``);
- ``steps``: a decode-only step's seconds and a prompt token's share of a step,
  measured (``step_budget.py``: the prompt budget beside decode rows), fed every step;
- per attached L3 backend, its read latency and bandwidth: kept by the L3 tier
  beside the ``auto`` prefetch allowance (``ReadTimeEstimate.read_cost``), read here.

``metrics`` flattens them into ``cost_*`` keys of ``engine.metrics()`` (so they
reach ``internal_states``, /get_server_info's ``cost_model`` block and /metrics the
way every engine number does); an estimate still unknown has no key.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache.engine.reuse_plan import CostSnapshot
from hicache.engine.step_budget import StepCostTracker
from hicache.estimators import (
    PrefillCoefficients,
    PrefillEstimate,
    TransferEstimate,
    attention_pairs,
)
from hicache.storage.bandwidth import ReadTimeEstimate

# Cold prompt lengths the prefill estimate is reported at (tokens).
REFERENCE_CONTEXTS = (1024, 4096, 16384)
# Pages a reference load (host->device, or L3 read) is reported at.
REFERENCE_PAGES = 64


def step_kind(new_tokens: int, pairs: int, decode_rows: int) -> tuple[bool, bool]:
    """A prefill step's kind, as its kernels differ: whether its prompts attend a cached
    prefix (more pairs than prompts alone could make: a cold step's ``pairs`` is at most
    ``attention_pairs(new_tokens, 0)``), and whether decode rows ran beside them."""
    return pairs > attention_pairs(new_tokens, 0), decode_rows > 0


class CostModel:
    def __init__(self, chunk_tokens: int | None = None, skip_warmup: bool = False) -> None:
        """``skip_warmup``: leave the first step of each kind out of the prefill fit (on
        devices whose kernels compile on first use: a GPU's Triton kernels)."""
        # The scheduler's chunked prefill: a long prompt is that many steps.
        self.chunk_tokens = chunk_tokens
        self.skip_warmup = skip_warmup
        self.prefill = PrefillEstimate()
        self.l2_load = TransferEstimate()
        self.steps = StepCostTracker()
        self._seen_kinds: set[tuple[bool, bool]] = set()
        self.warmup_steps_skipped = 0

    def observe_step(self, new_tokens: int, pairs: int, decode_rows: int,
                     seconds: float) -> bool:
        """A forward step that computed ``new_tokens`` prompt tokens (scheduler thread);
        False when the sample was left out (the first step of its kind: a warm-up)."""
        kind = step_kind(new_tokens, pairs, decode_rows)
        if self.skip_warmup and kind not in self._seen_kinds:
            # On a GPU the first step of each kind compiles its kernels (Triton: a 0.15 s
            # prefill measured near 1 s). Fed to the fit, it skews the first decisions a
            # fresh engine makes (until ``min_samples`` more dilute it). A CPU has no such
            # step: there every sample counts.
            self._seen_kinds.add(kind)
            self.warmup_steps_skipped += 1
            return False
        return self.prefill.observe(new_tokens, pairs, decode_rows, seconds)

    def observe_loads(self, samples: Iterable[tuple[int, float]]) -> None:
        """Landed host->device loads, as (pages, seconds)."""
        for pages, seconds in samples:
            self.l2_load.observe(pages, seconds)

    def predict_prefill(self, new_tokens: int, context: int = 0,
                        decode_rows: int = 0) -> float | None:
        """Seconds to compute ``new_tokens`` after ``context`` cached ones, chunk by chunk."""
        return self.prefill.predict_prompt(new_tokens, context, decode_rows, self.chunk_tokens)

    def snapshot(self, l3: ReadTimeEstimate | None = None) -> CostSnapshot:
        """The estimates as they stand, for a load-or-recompute plan (``reuse_plan.py``);
        ``l3``: the attached backend's read estimate."""
        coef = self.prefill.coefficients()
        read_latency = read_per_page = None
        if l3 is not None and l3.page_bytes > 0:
            per_byte = l3.read_cost.seconds_per_unit
            read_latency = l3.read_cost.latency_s
            read_per_page = None if per_byte is None else per_byte * l3.page_bytes
        return CostSnapshot(
            prefill=None if coef is None else PrefillCoefficients(**coef),
            chunk_tokens=self.chunk_tokens,
            load_latency_s=self.l2_load.latency_s,
            load_seconds_per_page=self.l2_load.seconds_per_unit,
            read_latency_s=read_latency,
            read_seconds_per_page=read_per_page,
            step=self.steps.snapshot(),
        )

    def metrics(self, l3: dict[str, ReadTimeEstimate] | None = None) -> dict[str, float]:
        """The ``cost_*`` numbers; ``l3``: each attached backend's read estimate by name."""
        out: dict[str, float] = {"cost_prefill_samples": float(self.prefill.num_samples)}
        coef = self.prefill.coefficients()
        if coef is not None:
            out.update({f"cost_prefill_coef_{k}": v for k, v in coef.items()})
            for tokens in REFERENCE_CONTEXTS:
                seconds = self.predict_prefill(tokens)
                if seconds is not None:
                    out[f"cost_prefill_seconds_per_token_context_{tokens}"] = seconds / tokens
        out["cost_l2_load_samples"] = float(self.l2_load.num_samples)
        latency, per_page = self.l2_load.latency_s, self.l2_load.seconds_per_unit
        if latency is not None and per_page is not None:
            out["cost_l2_load_latency_seconds"] = latency
            out["cost_l2_load_seconds_per_page"] = per_page
            out["cost_l2_load_reference_seconds"] = latency + REFERENCE_PAGES * per_page
        for name, read in (l3 or {}).items():
            out[f"cost_l3_read_samples_backend_{name}"] = float(read.read_cost.num_samples)
            latency, seconds = read.read_cost.latency_s, read.predict_read(REFERENCE_PAGES)
            if latency is None or seconds is None:
                continue
            out[f"cost_l3_read_latency_seconds_backend_{name}"] = latency
            out[f"cost_l3_read_reference_seconds_backend_{name}"] = seconds
            bandwidth = read.bandwidth_bytes_per_s
            if bandwidth is not None:
                out[f"cost_l3_read_bandwidth_bytes_per_second_backend_{name}"] = bandwidth
        return out
