"""Load or recompute: where a request's cached prefix should end, priced with live costs.

A request whose prompt is partly held by the host tier (L2) or by L3 may start
from any page boundary ``c`` between the end of its device hit and the end of what
the tiers hold: the pages before ``c`` are loaded (L3 pages are read into the host
first), the prompt from ``c`` on is computed. ``plan_reuse`` prices every such
``c`` with the instance's live costs (``CostSnapshot``, taken from the engine's cost
model) and keeps the fastest::

    T(c) = wait(c) + load(pages from the device hit to c) + prefill(rest | c cached)

- ``wait(c)``: zero while ``c`` stays within pages already on the host (the host
  hit, and the pages of an L3 prefetch that have landed); past them, one L3 read
  of the pages still to come up to ``c`` (the store's latency plus their bytes at
  its bandwidth);
- ``load``: the host->device copy of the pages past the device hit (its latency
  plus its time per page);
- ``prefill``: the forward steps that compute the rest of the prompt after ``c``
  cached tokens, chunk by chunk, beside the batch's decode rows.

The pieces add up (a conservative model: on a GPU the host->device load runs
layer by layer under the forward, so a load costs somewhat less than priced).
Under that sum T is concave in ``c`` within one source, so the winner is
usually an end (all loaded, or all recomputed) or the boundary of what has
already landed (a split: the landed pages are loaded and the rest computed
instead of waited for); the candidates are every page boundary (thinned to at
most ``MAX_CANDIDATES`` evenly spaced ones, both ends and the landed boundary
always in), so a cost model of another shape would still be minimised.

Loading everything is kept when it is predicted within ``LOAD_TOLERANCE`` (5%) plus
``LOAD_TOLERANCE_S`` (20 ms) of the fastest choice: it spares the batch's compute, and
a gain smaller than that is within what the model does not price (a lookup's round trip,
the scheduler's polling while a request waits).

Invariants: pure (no torch, no clock); ``c`` is a page boundary between the device
hit and the end of what the tiers hold, never below the device hit (device pages
cost nothing); a tie keeps the larger ``c`` (loading spares the batch's compute);
no plan is made (None) while a cost it needs is unknown: the tiers then act as
they always did (load what they hold, wait as the prefetch policy says).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hicache.engine.step_budget import StepCosts
from hicache.estimators import PrefillCoefficients, prompt_seconds

# Page boundaries priced per plan at most (the ends and the landed boundary come on top).
MAX_CANDIDATES = 64
# Loading everything is kept when it is predicted within this of the fastest choice: it
# spares the batch the compute, and the model does not price a load's small fixed costs
# (the lookup, the scheduler's polling), so a choice that wins by less is noise.
LOAD_TOLERANCE = 0.05
LOAD_TOLERANCE_S = 0.02


class Decision(str, Enum):
    LOAD = "load"  # every page the tiers hold is loaded
    RECOMPUTE = "recompute"  # nothing past the device hit is loaded
    SPLIT = "split"  # the first pages are loaded, the rest computed again
    UNPRICED = "unpriced"  # a cost was unknown: the tiers' default (load what they hold)


@dataclass(frozen=True)
class CostSnapshot:
    """The costs a plan is priced with, frozen at one moment (sent to every rank under
    tensor parallelism, so that the ranks decide alike). None: not known yet."""

    prefill: PrefillCoefficients | None
    chunk_tokens: int | None
    load_latency_s: float | None = None  # host->device, per load
    load_seconds_per_page: float | None = None
    read_latency_s: float | None = None  # the attached L3 backend, per read
    read_seconds_per_page: float | None = None
    # Measured step costs, for the prompt budget beside decode rows (``step_budget.py``).
    step: StepCosts | None = None

    def prefill_s(self, new_tokens: int, context: int, decode_rows: int) -> float | None:
        if self.prefill is None:
            return None
        if new_tokens <= 0:
            return 0.0
        return prompt_seconds(self.prefill, new_tokens, context, decode_rows, self.chunk_tokens)

    def load_s(self, pages: int) -> float | None:
        if pages <= 0:
            return 0.0
        if self.load_latency_s is None or self.load_seconds_per_page is None:
            return None
        return self.load_latency_s + pages * self.load_seconds_per_page

    def read_s(self, pages: int) -> float | None:
        if pages <= 0:
            return 0.0
        if self.read_latency_s is None or self.read_seconds_per_page is None:
            return None
        return self.read_latency_s + pages * self.read_seconds_per_page


@dataclass(frozen=True)
class ReuseSituation:
    """A request's prefix as the tiers hold it, in tokens (whole pages past the device hit).

    ``host_tokens`` follow the device hit; an L3 prefetch's ``found_tokens`` follow the
    host hit, ``landed_tokens`` of them already on the host.
    """

    prompt_tokens: int  # tokens the request's prefill ends at (the last one is always computed)
    page_size: int
    device_tokens: int
    host_tokens: int = 0
    landed_tokens: int = 0
    found_tokens: int = 0
    decode_rows: int = 0

    @property
    def host_end(self) -> int:
        return self.device_tokens + self.host_tokens

    @property
    def landed_end(self) -> int:
        return self.host_end + self.landed_tokens

    @property
    def cached_end(self) -> int:
        """The end of everything the tiers hold (the pure load's ``c``)."""
        return self.host_end + self.found_tokens


@dataclass(frozen=True)
class ReusePlan:
    cached_tokens: int  # c: the prompt is computed from here
    decision: Decision
    predicted_s: float  # T(c): until the prefill ends
    wait_s: float  # the part of it spent waiting for L3 pages still to land
    load_all_s: float  # T at the end of everything the tiers hold (pure load)
    recompute_s: float  # T at the end of the device hit (pure recompute)

    def waits(self, situation: ReuseSituation) -> bool:
        """Whether the plan needs L3 pages that have not landed yet."""
        return self.cached_tokens > situation.landed_end


def _candidates(s: ReuseSituation) -> list[int]:
    page = s.page_size
    first, last = s.device_tokens, s.cached_end
    num_pages = (last - first) // page
    stride = max(1, -(-num_pages // MAX_CANDIDATES))
    picks = {first + i * page for i in range(0, num_pages + 1, stride)}
    picks.update((first, last, min(s.landed_end, last), min(s.host_end, last)))
    return sorted(picks, reverse=True)  # largest first: a tie keeps the larger c


def price(s: ReuseSituation, costs: CostSnapshot, c: int) -> tuple[float, float] | None:
    """(T(c), wait(c)) for a cached prefix ending at ``c``; None if a cost is unknown."""
    page = s.page_size
    wait = 0.0
    if c > s.landed_end:
        read = costs.read_s((c - s.landed_end) // page)
        if read is None:
            return None
        wait = read
    load = costs.load_s((c - s.device_tokens) // page)
    compute = costs.prefill_s(s.prompt_tokens - c, c, s.decode_rows)
    if load is None or compute is None:
        return None
    return wait + load + compute, wait


def plan_reuse(s: ReuseSituation, costs: CostSnapshot) -> ReusePlan | None:
    """The fastest page boundary to start computing from; None when a cost is unknown.

    With nothing past the device hit there is nothing to choose: None as well.
    """
    if s.cached_end <= s.device_tokens:
        return None
    best: tuple[float, float, int] | None = None
    for c in _candidates(s):
        priced = price(s, costs, c)
        if priced is None:
            return None
        if best is None or priced[0] < best[0]:
            best = (priced[0], priced[1], c)
    assert best is not None
    load_all = price(s, costs, s.cached_end)
    recompute = price(s, costs, s.device_tokens)
    assert load_all is not None and recompute is not None
    seconds, wait, c = best
    if load_all[0] <= seconds * (1 + LOAD_TOLERANCE) + LOAD_TOLERANCE_S:
        seconds, wait, c = load_all[0], load_all[1], s.cached_end
    decision = decision_for(c, s.device_tokens, s.cached_end)
    return ReusePlan(c, decision, seconds, wait, load_all[0], recompute[0])


def decision_for(cached_tokens: int, device_tokens: int, available_end: int) -> Decision:
    """The name of a choice of ``cached_tokens`` among what the tiers offered."""
    if cached_tokens >= available_end:
        return Decision.LOAD
    if cached_tokens <= device_tokens:
        return Decision.RECOMPUTE
    return Decision.SPLIT
