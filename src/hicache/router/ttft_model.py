"""One worker's predicted time to first token for one request, in seconds, from the
live cost model it measured (the predicted_ttft policy's score, and the prediction every
tier_aware decision reports beside the measured TTFT: ``ttft_policy.py`` says how)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hicache.engine.reuse_plan import CostSnapshot, ReuseSituation, plan_reuse
from hicache.router.device_room import room_wait_s
from hicache.router.live_costs import resolve_costs
from hicache.router.types import RouteRequest, TierOverlap, WorkerLoad


@dataclass(frozen=True)
class TTFTTerms:
    """One worker's predicted TTFT for one request, in seconds."""

    queue_s: float  # its ledger: prefill ahead of this one
    own_s: float  # this request's prefill there (loads and compute)
    load_s: float  # of own_s: reading L3 pages and loading host pages
    decode_s: float  # of own_s: its decoding requests slowing the prefill steps
    cached_tokens: int  # where its plan starts computing
    # Until its device has room for it beside what runs there (``device_room.py``); the
    # prefill queue runs meanwhile, so the longer of the two comes before its own.
    room_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return max(self.queue_s, self.room_s) + self.own_s

    def as_dict(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in asdict(self).items()}, "ttft_s": self.ttft_s}


def predict(request: RouteRequest, worker: WorkerLoad, overlap: TierOverlap,
            shared_pages: int, costs: CostSnapshot, page: int) -> TTFTTerms:
    """``worker``'s predicted TTFT; ``shared_pages``: L3 pages right past its host prefix
    (the contiguous run it could read); ``costs``: resolved (every figure known)."""
    prompt = request.prompt_tokens
    device = min(overlap.gpu * page, prompt)
    host = min(max(0, overlap.host - overlap.gpu) * page, prompt - device)
    found = min(shared_pages * page, prompt - device - host)
    rows = worker.decoding_requests
    situation = ReuseSituation(prompt_tokens=prompt, page_size=page, device_tokens=device,
                               host_tokens=host, found_tokens=found, decode_rows=rows)
    plan = plan_reuse(situation, costs)
    cached = device if plan is None else plan.cached_tokens
    compute = _prefill(costs, prompt - cached, cached, rows)
    own = compute if plan is None else plan.predicted_s
    decode = compute - _prefill(costs, prompt - cached, cached, 0)
    # Admission takes its context's pages and one to decode into (engine/scheduler.py).
    room = room_wait_s(worker.device_pages, worker.in_flight, -(-prompt // page) + 1)
    return TTFTTerms(queue_s=worker.queued_prefill_s, own_s=own, load_s=max(0.0, own - compute),
                     decode_s=max(0.0, decode), cached_tokens=cached, room_s=room)


def _prefill(costs: CostSnapshot, new_tokens: int, context: int, rows: int) -> float:
    seconds = costs.prefill_s(new_tokens, context, rows)
    assert seconds is not None  # resolved costs always have a prefill fit
    return seconds


def predict_for(request: RouteRequest, worker: WorkerLoad, workers: Sequence[WorkerLoad],
                overlap: TierOverlap, hits: Sequence[bool] | None, page: int,
                ) -> tuple[TTFTTerms, tuple[str, ...]]:
    """``worker``'s prediction among ``workers`` (whose costs fill what it has not
    measured: ``live_costs.resolve_costs``), and the figures so filled."""
    others = [w.costs for w in workers if w is not worker]
    costs, filled = resolve_costs(worker.costs, others, page)
    return predict(request, worker, overlap, shared_run(overlap, hits), costs, page), filled


def shared_run(overlap: TierOverlap, hits: Sequence[bool] | None) -> int:
    """L3 pages right past the worker's host prefix: the shared pool's contiguous run
    when it answered, else what the workers announced to the index."""
    if hits is None:
        return max(0, overlap.external - overlap.host)
    run = 0
    for hit in hits[overlap.host:]:
        if not hit:
            break
        run += 1
    return run
