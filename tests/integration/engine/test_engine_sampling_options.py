"""Sampling options through the engine: max_new_tokens 0 (prefill only, the way clients
warm the cache), min_new_tokens, and the repetition / frequency / presence penalties."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.engine.engine import Engine
from tests.engine_helpers import run

PAGE = 16
FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "4096")


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def test_zero_new_tokens_computes_and_caches_the_prompt(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(1, 70)
    warm = run(engine, ids, max_new_tokens=0)
    assert warm.token_ids == [] and warm.text == ""
    assert warm.last.finished and warm.last.finish_reason == "length"
    assert warm.last.completion_tokens == 0 and warm.last.error is None
    assert engine.scheduler.counters.num_generated_tokens == 0
    # The prompt's whole pages are in the tree: the next request reuses them.
    again = run(engine, ids, max_new_tokens=2)
    assert again.last.cached_tokens.total == 64
    engine.check_integrity()


def test_min_new_tokens_masks_the_ending_tokens(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(2, 30)
    free = run(engine, ids, max_new_tokens=8, ignore_eos=True)
    first = free.token_ids[0]
    # The greedy first token as a stop token ends the request at once ...
    stopped = run(engine, ids, max_new_tokens=8, stop_token_ids=(first,))
    assert stopped.token_ids == [first] and stopped.last.finish_reason == "stop"
    # ... unless at least 3 tokens must come out: it cannot be drawn before that.
    held = run(engine, ids, max_new_tokens=8, stop_token_ids=(first,), min_new_tokens=3)
    assert len(held.token_ids) >= 3
    assert first not in held.token_ids[:3]
    assert held.token_ids[0] != first


def test_min_new_tokens_defers_stop_strings(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(5, 30)  # the tiny model answers it with printable text
    free = run(engine, ids, max_new_tokens=6, ignore_eos=True)
    stop = free.text[:1]
    assert stop
    early = run(engine, ids, max_new_tokens=6, ignore_eos=True, stop=(stop,))
    assert early.last.finish_reason == "stop" and len(early.token_ids) < 6
    late = run(engine, ids, max_new_tokens=6, ignore_eos=True, stop=(stop,), min_new_tokens=6)
    assert late.token_ids == free.token_ids and late.last.finish_reason == "length"


def expected_penalised(raw: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                       repetition: float, frequency: float, presence: float) -> torch.Tensor:
    """The penalties by hand, one token at a time."""
    out = raw.clone()
    for token in set(prompt_ids) | set(output_ids):
        value = float(out[token])
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output_ids):
        out[token] -= frequency * output_ids.count(token) + presence
    return out


def test_penalties_apply_to_each_step_as_computed_by_hand(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    ids = prompt(4, 24)
    options = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.25}
    penalised = run(engine, ids, logits=True, max_new_tokens=5, ignore_eos=True, **options)
    again = run(engine, ids, max_new_tokens=5, ignore_eos=True, **options)
    assert again.token_ids == penalised.token_ids  # greedy with penalties: deterministic
    for step, seen in enumerate(penalised.logits):
        output = penalised.token_ids[:step]
        # The model's own logits at this step: the same context, without penalties.
        raw = run(engine, ids + output, logits=True, max_new_tokens=1).logits[0]
        want = expected_penalised(raw, ids, output, **{
            "repetition": 1.5, "frequency": 0.5, "presence": 0.25})
        torch.testing.assert_close(seen, want, rtol=1e-4, atol=1e-4)
        assert penalised.token_ids[step] == int(want.argmax())
    plain = run(engine, ids, max_new_tokens=5, ignore_eos=True)
    assert plain.token_ids != penalised.token_ids
