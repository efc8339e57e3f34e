"""--max-decode-delay-ms (or -factor) in an engine: a long prompt prefilling beside
decoding requests is cut into small chunks, the decodes gain a token every step, the chunk
is full again when nothing decodes, and the greedy tokens equal those of an engine without
the budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache.engine.api import GenerateRequest, LogprobParams, SamplingParams
from hicache.engine.engine import Engine
from hicache.engine.request import Phase, Req
from hicache.engine.step_budget import StepCosts
from tests.engine_helpers import on_scheduler, run_many

CHUNK = 256
# 1 ms per prompt token: a 32 ms delay buys 32 tokens, and so does twice a 16 ms
# decode-only step.
COSTS = StepCosts(decode_step_s=0.016, prompt_token_s=1e-3)
BUDGET = 32
LONG = 700


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def greedy(ids: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(tuple(ids), SamplingParams(max_new_tokens=n, temperature=0.0,
                                                      ignore_eos=True))


def record_steps(engine: Engine) -> list[list[tuple[str, Phase, int, int]]]:
    """Each forward's plan as (rid, phase, prompt length, tokens), in step order."""
    steps: list[list[tuple[str, Phase, int, int]]] = []
    runner = engine.scheduler.runner
    forward = runner.forward

    def recording(plan: list[tuple[Req, int]], *args: Any) -> Any:
        steps.append([(req.rid, req.phase, req.prompt_len, n) for req, n in plan])
        return forward(plan, *args)

    runner.forward = recording  # type: ignore[method-assign]
    return steps


def fix_costs(engine: Engine) -> None:
    # Measured costs vary with the machine's load: price with fixed ones instead, through
    # the hook tensor parallelism shares rank 0's costs with.
    reuse = engine.scheduler.reuse
    on_scheduler(engine, lambda: setattr(
        reuse, "shared_costs", dataclasses.replace(reuse.local_costs(), step=COSTS)))


@pytest.mark.parametrize("delay", [("--max-decode-delay-ms", str(BUDGET)),
                                   ("--max-decode-delay-factor", "2")])
def test_decodes_progress_every_step_while_a_long_prompt_prefills(
    make_engine: Callable[..., Engine], delay: tuple[str, str],
) -> None:
    flags = ("--page-size", "4", "--chunked-prefill-size", str(CHUNK))
    requests = [greedy(prompt(i, 8), n=48) for i in range(3)] + [greedy(prompt(9, LONG), n=4)]
    expected = [r.token_ids for r in run_many(make_engine(*flags), requests)]

    engine = make_engine(*flags, *delay)
    fix_costs(engine)
    steps = record_steps(engine)
    results = run_many(engine, requests)
    assert [r.token_ids for r in results] == expected

    overlapped = 0
    for plan in steps:
        decoding = [rid for rid, phase, _, _ in plan if phase is Phase.DECODE]
        prompt_tokens = sum(n for _, phase, _, n in plan if phase is Phase.PREFILL)
        if decoding and prompt_tokens:
            overlapped += 1
            assert prompt_tokens <= BUDGET, plan
    # The long prompt took more than one budgeted chunk beside the decodes.
    assert overlapped >= 2
    # A decode row is in every step from its first decode to its last: never skipped.
    for rid in {rid for plan in steps for rid, phase, _, _ in plan if phase is Phase.DECODE}:
        present = [i for i, plan in enumerate(steps)
                   if any(r == rid and p is Phase.DECODE for r, p, _, _ in plan)]
        assert present == list(range(present[0], present[-1] + 1)), rid

    # Alone, a long prompt takes the full chunk: nothing decodes beside it.
    steps.clear()
    run_many(engine, [greedy(prompt(10, LONG), n=2)])
    chunks = [n for plan in steps for _, phase, length, n in plan
              if phase is Phase.PREFILL and length == LONG]
    assert chunks[0] == CHUNK, chunks
    assert sum(chunks) == LONG


def test_cpu_default_steps_give_one_long_prompt_the_chunk_and_several_take_turns(
    make_engine: Callable[..., Engine],
) -> None:
    """The CPU's default steps (no --chunked-prefill-size): a long prompt alone fills a
    step up to CPU_CHUNKED_PREFILL_SIZE; once a step holds CPU_PROMPT_SHARE_TOKENS prompt
    tokens no further prompt joins it; the tokens equal those of a hand-given chunk."""
    from hicache.engine.config import CPU_CHUNKED_PREFILL_SIZE, CPU_PROMPT_SHARE_TOKENS

    flags = ("--page-size", "4")
    engine = make_engine(*flags)
    assert engine.chunked_prefill_size == CPU_CHUNKED_PREFILL_SIZE
    steps = record_steps(engine)
    long = CPU_CHUNKED_PREFILL_SIZE - 100
    run_many(engine, [greedy(prompt(20, long), n=2)])
    assert [n for plan in steps for _, phase, _, n in plan if phase is Phase.PREFILL] == [long]

    # Prompts longer than the share, submitted together, and a few short ones.
    lengths = [CPU_PROMPT_SHARE_TOKENS + 44] * 3 + [40, 40, 40]
    requests = [greedy(prompt(30 + i, n), n=3) for i, n in enumerate(lengths)]
    steps.clear()
    results = run_many(engine, requests)
    shared = 0
    for plan in steps:
        prompt_tokens = [n for _, phase, _, n in plan if phase is Phase.PREFILL]
        # Every prompt but the step's last joined while the step held fewer than the share.
        for k in range(1, len(prompt_tokens)):
            assert sum(prompt_tokens[:k]) < CPU_PROMPT_SHARE_TOKENS, plan
        shared += len(prompt_tokens) > 1
    assert shared >= 1  # the short prompts shared a step
    # Every prompt was computed whole, in steps of at most the chunk.
    for rid, length in {(rid, n) for plan in steps for rid, _, n, _ in plan}:
        assert sum(n for plan in steps for r, phase, _, n in plan
                   if r == rid and phase is Phase.PREFILL) == length

    by_hand = run_many(make_engine(*flags, "--chunked-prefill-size", "64"), requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in by_hand]

    # A prompt asking its logprobs keeps every row's logits: held to the share (what the
    # memory reserve assumes), beside a prompt that does not ask.
    asking = GenerateRequest(
        tuple(prompt(40, long)),
        SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        logprobs=LogprobParams(input_from=0),
    )
    steps.clear()
    run_many(engine, [greedy(prompt(41, 40), n=2), asking])
    chunks = [n for plan in steps for _, phase, length, n in plan
              if phase is Phase.PREFILL and length == long]
    assert sum(chunks) == long and max(chunks) <= CPU_PROMPT_SHARE_TOKENS, chunks


def test_measured_costs_are_sampled_where_prompts_never_let_a_step_decode_alone(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the engine's own costs (not fixed): the first step that has decode rows beside
    an unfinished prompt decodes alone (the sample the budget prices with; before, a
    server whose prompts kept arriving never ran a decode-only step and the budget never
    applied), and so does one step in every DECODE_SAMPLE_EVERY with decode rows; the
    tokens equal an engine's without the budget."""
    from hicache.engine import step_budget

    every = 3
    monkeypatch.setattr(step_budget, "DECODE_SAMPLE_EVERY", every)
    flags = ("--page-size", "4", "--chunked-prefill-size", str(CHUNK))
    requests = [greedy(prompt(i, 8), n=40) for i in range(3)] + [greedy(prompt(9, LONG), n=4)]
    expected = [r.token_ids for r in run_many(make_engine(*flags), requests)]

    engine = make_engine(*flags, "--max-decode-delay-factor", "2")
    steps = record_steps(engine)
    results = run_many(engine, requests)
    assert [r.token_ids for r in results] == expected

    def shape(plan: list[tuple[str, Phase, int, int]]) -> tuple[int, int]:
        rows = sum(1 for _, phase, _, _ in plan if phase is Phase.DECODE)
        return rows, sum(n for _, phase, _, n in plan if phase is Phase.PREFILL)

    shapes = [shape(plan) for plan in steps]
    long_done = max(i for i, plan in enumerate(steps)
                    if any(length == LONG and phase is Phase.PREFILL
                           for _, phase, length, _ in plan))
    first_rows = next(i for i, (rows, _) in enumerate(shapes) if rows)
    assert first_rows < long_done, shapes  # the decodes began while the long prompt waited
    assert shapes[first_rows][1] == 0, shapes  # ... and their first step was a sample
    # Between samples, at most `every` steps carry decode rows and prompt tokens together.
    run = 0
    for rows, tokens in shapes:
        if rows and tokens:
            run += 1
            assert run <= every, shapes
        elif rows:
            run = 0
