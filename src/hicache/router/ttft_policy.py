"""``predicted_ttft``: send a request where its first token is predicted soonest.

For each candidate worker the policy predicts the request's time to first token
there, in seconds, from what the workers measured (no weight to tune)::

    ttft = max(queue_s, room_s) + own_s
    own_s = plan(device pages ~ 0, host pages loaded, L3 pages read and loaded,
                 the rest computed beside the worker's decoding requests)

- ``queue_s``: the router's ledger of that worker (``ledger.py``): the predicted
  prefill of the requests it sent there still waiting for their first token, less
  what the worker has worked off since the queue last moved;
- ``room_s``: until its device pool has room for the request's pages beside those of
  the requests the router sent there that have not ended, freed in the order they are
  predicted to end (their queued prefill, then the worker's recent decode time as the
  ledger measured it: ``device_room.py``); 0 where it fits now or the worker does not
  say its pool's size;
- ``own_s``: the worker's own load-or-recompute plan (``engine.reuse_plan.plan_reuse``,
  the one the worker runs when the request arrives) priced with its live cost model
  (``live_costs.py``): its device prefix costs nothing, its host pages the measured
  L2->L1 load, the L3 pages past them the measured read then load, only as far as
  that beats recomputing them, and the rest the prefill fit at this context (the
  attention term makes a long context's tokens dearer), split in the scheduler's
  chunks, each step slowed by the worker's decoding requests (the fit's per decode
  row term: ``decode_s`` is that share).

Which pages a worker holds comes from the tier index; the shared L3's pages from
the shared pool's answer when it is asked (``--shared-cache-type``, as tier_aware
asks it: its deadline, its fallback to the index), else from what the workers
announced. A worker whose costs are not measured yet is priced with the median of
the others', else conservative defaults (``live_costs.resolve_costs``); the decision
names the figures it filled (``RouteDecision.fallbacks``).

What the ledger cannot see: requests that reached a worker another way (another router,
a client calling it directly), and the prefill of a prefill-decode router (the PD proxy
enters nothing). The workers report no queue in seconds, so those are not priced.

With ``--ttft-score cluster`` the score is the request's cost to the cluster, not to
itself alone::

    cost = ttft + work_s * (prefilling + decoding + usage)

- ``work_s``: the forward time it adds there (``own_s`` less its loads, which run beside
  the forward);
- ``prefilling + decoding``: the requests the router has in flight there (its ledger).
  Each is held up by about ``work_s``: a queued prompt shares its steps with this one's
  chunks, a decoding request waits for them between its tokens;
- ``usage``: how full its cache is (``WorkerLoad.cache_usage``, 1 until probed): in a
  full cache every page it computes there pushes out one that another request may need
  again, and computes again.

Each term is a count or a measured figure, none a tuned weight. Against the own score
it keeps a turn on the worker holding its prefix until the wait there outweighs what
recomputing it elsewhere costs everybody there, which grows with the load; the
tier_aware default's weight 4 was tuned to the same effect on one load.

The lowest score wins (to the microsecond); ties go to fewer requests in flight,
then the worker chosen least recently, then registration order (``policy.py``). The
decision carries the chosen worker's prediction and its terms; the proxy enters
``own_s`` in that worker's ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from hicache.router.policy import PolicyName, TierAwarePolicy, TTFTScore, _check, _page_size
from hicache.router.ttft_model import TTFTTerms, predict_for, shared_run
from hicache.router.types import RouteDecision, RouteRequest, WorkerLoad

# Predictions closer than this (seconds) are a tie: the model is not that exact.
_TIE_DIGITS: Final = 6


class PredictedTTFTPolicy(TierAwarePolicy):
    name = PolicyName.PREDICTED_TTFT.value

    async def choose(self, request: RouteRequest, token_ids: Sequence[int]) -> RouteDecision:
        _check(request)
        page = _page_size(request)
        overlaps, hits, outcome = await self._lookup(request, token_ids)
        terms: dict[str, TTFTTerms] = {}
        fallbacks: dict[str, tuple[str, ...]] = {}
        for worker in request.workers:
            terms[worker.url], fallbacks[worker.url] = predict_for(
                request, worker, request.workers, overlaps[worker.url], hits, page)
        cluster = self.config.ttft_score == TTFTScore.CLUSTER.value
        score = {w.url: cluster_cost(terms[w.url], w) if cluster else terms[w.url].ttft_s
                 for w in request.workers}
        best = self._lowest(request.workers, score, _TIE_DIGITS, record=False)
        # The home may cost at most the request's own prefill (at the best) more.
        url, home = self._home_or(
            request, best, lambda home: score[home] <= score[best] + terms[best].own_s)
        return RouteDecision(
            worker=url, policy=self.name, logits=score, overlaps=overlaps,
            shared_hits=None if hits is None else sum(hits),
            shared_beyond=0 if hits is None else shared_run(overlaps[url], hits),
            shared_outcome=None if outcome is None else outcome.value,
            predicted_ttft_s=terms[url].ttft_s, terms=terms[url].as_dict(),
            fallbacks=fallbacks[url], home=home,
            # What its plan computes there, as the ledger counts pending pages.
            prefill_pages=max(0, request.prompt_tokens - terms[url].cached_tokens) / page,
        )


def cluster_cost(terms: TTFTTerms, worker: WorkerLoad) -> float:
    """The request's predicted TTFT at ``worker`` plus the delay its forward there causes
    the requests in flight there and the cached pages it evicts (module docstring)."""
    work_s = max(0.0, terms.own_s - terms.load_s)
    usage = 1.0 if worker.cache_usage is None else worker.cache_usage
    others = worker.prefilling_requests + worker.decoding_requests + usage
    return terms.ttft_s + work_s * others
