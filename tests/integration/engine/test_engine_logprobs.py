"""Log probabilities through the engine: of the output tokens, of the prompt from a position,
their top tokens and asked tokens; all of the model's raw distribution.

Prompt logprobs need the logits of prompt positions, which a cached prefix does not
recompute: a request asking them from position p reuses at most p - 1 tokens, and its
logprobs equal a cold run's whatever the cache holds.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import torch

from hicache.engine.api import GenerateRequest, LogprobParams, SamplingParams, TokenLogprob
from hicache.engine.engine import Engine
from tests.engine_helpers import Run, collect

PAGE = 16
FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "4096")


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def ask(
    engine: Engine, ids: list[int], logprobs: LogprobParams, observe: bool = False,
    **sampling: object,
) -> tuple[Run, list[torch.Tensor]]:
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 6, **sampling})  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    if observe:
        engine.scheduler.postprocess.logits_observer = lambda rid, row: seen.append(row)
    try:
        result = asyncio.run(collect(engine, GenerateRequest(tuple(ids), params,
                                                             logprobs=logprobs)))
    finally:
        engine.scheduler.postprocess.logits_observer = None
    return result, seen


def output_logprobs(run: Run) -> list[TokenLogprob]:
    return [lp for out in run.outputs for lp in out.output_logprobs]


def input_logprobs(run: Run) -> list[TokenLogprob]:
    return [lp for out in run.outputs for lp in out.input_logprobs]


def assert_logprobs_close(a: list[TokenLogprob], b: list[TokenLogprob]) -> None:
    assert [x.token_id for x in a] == [y.token_id for y in b]
    assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in y.top] for y in b]
    for x, y in zip(a, b, strict=True):
        if x.logprob is None or y.logprob is None:
            assert x.logprob is y.logprob is None
            continue
        assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
        for (_, u), (_, v) in zip(x.top, y.top, strict=True):
            assert math.isclose(u, v, abs_tol=1e-4)


def test_output_logprobs_are_the_raw_distribution(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(1, 40)
    asked = (3, 7)
    # Sampled at temperature 2: the logprobs are still those of the model's logits.
    run, seen = ask(engine, ids, LogprobParams(top_n=4, token_ids=asked), observe=True,
                    temperature=2.0, seed=5, ignore_eos=True)
    entries = output_logprobs(run)
    assert len(entries) == len(run.token_ids) == len(seen) == 6
    for entry, token, logits in zip(entries, run.token_ids, seen, strict=True):
        expected = torch.log_softmax(logits.float(), dim=-1)
        assert entry.token_id == token
        assert entry.logprob is not None
        assert math.isclose(entry.logprob, float(expected[token]), abs_tol=1e-5)
        values, indices = expected.topk(4)
        assert [t for t, _ in entry.top] == indices.tolist()
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        for (_, got), want in zip(entry.top, values.tolist(), strict=True):
            assert math.isclose(got, want, abs_tol=1e-5)
        for got, token_id in zip(entry.asked, asked, strict=True):
            assert math.isclose(got, float(expected[token_id]), abs_tol=1e-5)
    assert input_logprobs(run) == []


def test_prompt_logprobs_from_a_position_equal_a_cold_run_though_the_prefix_is_cached(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(2, 100)
    start = 50
    params = LogprobParams(top_n=3, input_from=start)
    cold, _ = ask(engine, ids, params)
    # Now the whole prompt is cached (its 6 whole pages).
    warm, _ = ask(engine, ids, LogprobParams())
    assert warm.last.cached_tokens.total == 96
    cached, _ = ask(engine, ids, params)
    # Reused at most start - 1 = 49 tokens: three whole pages.
    assert cached.last.cached_tokens.total == 48
    entries = input_logprobs(cached)
    assert len(entries) == len(ids) - start
    assert [e.token_id for e in entries] == ids[start:]
    assert all(e.logprob is not None and e.logprob <= 0 for e in entries)
    assert_logprobs_close(entries, input_logprobs(cold))
    assert_logprobs_close(output_logprobs(cached), output_logprobs(cold))
    engine.check_integrity()


def test_prompt_logprobs_from_zero_start_with_none_and_match_a_whole_prefill(
    make_engine: Callable[..., Engine],
) -> None:
    """From position 0 the first entry has no logprob; computed in 32-token chunks they
    equal one whole prefill's (another engine)."""
    ids = prompt(3, 90)
    params = LogprobParams(top_n=2, input_from=0)
    chunked, _ = ask(make_engine(*FLAGS, "--chunked-prefill-size", "32"), ids, params)
    whole, _ = ask(make_engine(*FLAGS), ids, params)
    entries = input_logprobs(chunked)
    assert len(entries) == len(ids)
    assert entries[0] == TokenLogprob(token_id=ids[0], logprob=None)
    assert_logprobs_close(entries, input_logprobs(whole))


def test_logprobs_of_one_request_leave_its_batch_neighbours_alone(
    make_engine: Callable[..., Engine],
) -> None:
    """Prompt logprobs change which logits a step computes; a request beside it without
    logprobs gets the tokens it gets alone."""
    engine = make_engine(*FLAGS)
    a, b = prompt(4, 70), prompt(5, 33)
    alone, _ = ask(engine, b, LogprobParams())
    engine.flush_cache()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)

    async def both() -> list[Run]:
        return list(await asyncio.gather(
            collect(engine, GenerateRequest(tuple(a), greedy,
                                            logprobs=LogprobParams(input_from=10))),
            collect(engine, GenerateRequest(tuple(b), greedy)),
        ))

    with_logprobs, plain = asyncio.run(both())
    assert plain.token_ids == alone.token_ids
    assert len(input_logprobs(with_logprobs)) == 60
    assert all(not out.output_logprobs for out in plain.outputs)
