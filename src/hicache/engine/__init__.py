"""The serving engine: scheduler thread, requests, sampling, and the API the server uses.

- ``api.py``: ``EngineProtocol`` and its requests and outputs (what is exported here);
  ``engine.py``: the ``Engine``; ``build.py``: ``build_engine`` from a frozen
  ``EngineConfig`` (``config.py``, beside ``SchedulerLimits``);
- ``scheduler.py``: admission, batch planning and the step loop; ``lifecycle.py``: a
  request's state after admission (tokens, stops, retraction, finish);
  ``postprocess.py``: a step's logits to tokens (with ``penalties.py``,
  ``grammar.py``'s masks, ``sampling.py``, ``logprobs.py``); ``counters.py``: what
  the scheduler counts;
- beside it: the model runner and its page table, the output thread, the L3
  prefetches of waiting requests (``prefetcher.py``), and the named cache operations
  (``cache_ops.py``) and disaggregation hooks (``pd_prefill.py``, ``pd_decode.py``),
  which see the scheduler and the lifecycle only through the interfaces they declare;
- the engine in a process of its own (``engine_process.py``, ``engine_client.py``) and
  under tensor parallelism (``replication.py``, ``start_agreement.py``).
"""

from hicache.engine.api import (
    CachedTokens,
    EngineProtocol,
    GenerateOutput,
    GenerateRequest,
    LogprobParams,
    RequestError,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "CachedTokens",
    "EngineProtocol",
    "GenerateOutput",
    "GenerateRequest",
    "LogprobParams",
    "RequestError",
    "SamplingParams",
    "TokenLogprob",
]
