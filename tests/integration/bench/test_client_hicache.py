"""The benchmark client against the project's own server (in-process, real HTTP on loopback)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator

import pytest

from hicache.bench.client import ApiStyle, BenchClient, RequestResult
from hicache.bench.multiturn import Pacing, run_sessions
from hicache.bench.report import RunSummary
from hicache.bench.workload import PromptMaker, PromptStyle, multiturn_sessions

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hicache.server.app") is None, reason="hicache.server.app is missing"
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from tests.server_fixtures import serve_in_thread

    with serve_in_thread(["--enable-hierarchical-cache"]) as server:
        yield server.url


def send_twice(url: str, api: ApiStyle, prompt: list[int] | str) -> list[RequestResult]:
    async def go() -> list[RequestResult]:
        async with BenchClient(url, api) as client:
            return [await client.send(prompt, 6), await client.send(prompt, 6)]

    return asyncio.run(go())


@pytest.mark.parametrize("api", list(ApiStyle))
@pytest.mark.parametrize("style", list(PromptStyle))
def test_repeat_hits_the_cache(url: str, api: ApiStyle, style: PromptStyle) -> None:
    import numpy as np

    # A different prompt per case, so no case hits what another cached.
    seed = list(ApiStyle).index(api) * 2 + list(PromptStyle).index(style)
    prompt = PromptMaker(style).make(np.random.default_rng(100 + seed), 96)
    cold, warm = send_twice(url, api, prompt)
    for result in (cold, warm):
        assert result.ok, result.error
        assert result.output_tokens == 6
        assert result.ttft_s is not None and 0 < result.ttft_s <= result.latency_s
        assert result.prompt_tokens is not None and result.prompt_tokens >= 96
    assert cold.cached_tokens == 0
    # Whole pages of the prompt (16 tokens each) come back from the cache.
    assert warm.cached_tokens is not None and warm.cached_tokens >= 80
    if api is ApiStyle.GENERATE:
        assert warm.cached_by_tier is not None
        assert sum(warm.cached_by_tier.values()) == warm.cached_tokens
        assert warm.output_ids is not None and len(warm.output_ids) == 6
        # Each request went with an id of its own, and the server said of its part: its
        # TTFT, within the client's.
        assert cold.rid and warm.rid and cold.rid != warm.rid
        for result in (cold, warm):
            assert result.server_ttft_s is not None and result.ttft_s is not None
            assert 0 < result.server_ttft_s <= result.ttft_s
    else:
        assert cold.rid is None and cold.server_ttft_s is None


def test_multiturn_rounds_reuse_the_conversation(url: str) -> None:
    maker = PromptMaker(PromptStyle.TOKENS)
    sessions = multiturn_sessions(3, 3, 64, 16, 4, maker, seed=11)

    async def go() -> RunSummary:
        async with BenchClient(url, ApiStyle.GENERATE) as client:
            records = await run_sessions(client, sessions, Pacing(max_inflight=3), maker)
        return RunSummary.of("hicache", records)

    summary = asyncio.run(go())
    assert summary.overall.failed == 0 and summary.overall.requests == 9
    assert [g.requests for g in summary.rounds] == [3, 3, 3]
    assert summary.rounds[0].hit_rate == 0
    # Round 2 prompts are 64 + 2 x (4 + 16) = 104 tokens, of which at least the
    # 80 whole pages of the previous context are cached.
    assert summary.rounds[2].hit_rate is not None and summary.rounds[2].hit_rate >= 80 / 104
