"""The serving engine: scheduler thread, requests, sampling, and the API the server uses."""

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
