"""Batched sampling: each row's distribution, its seed's independence from the batch, and
what a row with nothing to draw from gets.

The distribution tests draw many times (fixed seeds, so they are deterministic) and
compare with the distribution computed here by definition in float64: a chi-square
statistic far below what a wrong distribution gives, and the exact set of tokens drawn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

import hicache.engine.postprocess as postprocess_module
from hicache.engine.api import GenerateRequest, SamplingParams
from hicache.engine.engine import Engine
from hicache.engine.sampling import (
    MAX_WINDOW_TOKENS,
    TOP_P_WINDOW_TOKENS,
    make_generator,
    sample_tokens,
)
from tests.engine_helpers import run_many

CPU = torch.device("cpu")


def random_logits(vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """[vocab] distinct float32 logits."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``params`` define over ``logits`` [vocab], in float64, written
    from the definitions: temperature, then the top k, then the smallest prefix of those
    whose share of their mass reaches top_p."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    kept = len(order)
    if 0 < params.top_k < kept:
        kept = params.top_k
    ranked = probs[order[:kept]] / probs[order[:kept]].sum()
    if params.top_p < 1.0:
        running = 0.0
        for n, p in enumerate(ranked.tolist(), start=1):
            running += p
            if running >= params.top_p:
                kept = n
                break
    out = torch.zeros_like(probs)
    out[order[:kept]] = probs[order[:kept]]
    return out / out.sum()


def draw_many(logits: torch.Tensor, params: SamplingParams, num_draws: int,
              seed: int = 0, rows_per_call: int = 2048) -> torch.Tensor:
    """Token counts [vocab] of ``num_draws`` draws from ``logits`` [vocab], each draw a row
    with its own seeded generator."""
    counts = torch.zeros(len(logits), dtype=torch.int64)
    done = 0
    while done < num_draws:
        rows = min(rows_per_call, num_draws - done)
        batch = logits.expand(rows, -1).contiguous()
        generators = [torch.Generator().manual_seed(seed * 1_000_003 + done + i)
                      for i in range(rows)]
        tokens = sample_tokens(batch, [params] * rows, generators)
        assert None not in tokens
        counts += torch.bincount(torch.tensor(tokens), minlength=len(logits))
        done += rows
    return counts


def chi_square_excess(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """How many standard deviations the chi-square statistic of ``counts`` against
    ``probs`` lies above its mean (tokens with under 5 expected draws pooled)."""
    total = int(counts.sum())
    expected = probs * total
    big = expected >= 5
    observed = [*counts[big].double().tolist(), float(counts[~big].sum())]
    wanted = [*expected[big].tolist(), float(expected[~big].sum())]
    if wanted[-1] < 5:  # too little to pool: merge into the smallest bin
        observed[-2] += observed.pop()
        wanted[-2] += wanted.pop()
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True))
    dof = len(wanted) - 1
    return (statistic - dof) / math.sqrt(2 * dof)


CASES = {
    # name: (vocab, params); comments say which way the rows take
    "temperature alone": (600, SamplingParams(temperature=0.7)),  # whole row, no sort
    "hot temperature": (600, SamplingParams(temperature=1.8)),
    "top-k window": (600, SamplingParams(temperature=1.0, top_k=50)),
    "top-k beyond the window": (1100, SamplingParams(temperature=2.0, top_k=1050)),
    "top-p window": (600, SamplingParams(temperature=0.5, top_p=0.8)),
    "top-p beyond the window": (600, SamplingParams(temperature=1.5, top_p=0.9)),
    "top-k then top-p": (600, SamplingParams(temperature=1.0, top_k=40, top_p=0.6)),
    "top-k over the vocabulary": (600, SamplingParams(temperature=1.0, top_k=600)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_distribution(name: str) -> None:
    vocab, params = CASES[name]
    logits = random_logits(vocab, seed=len(name))
    probs = expected_probs(logits, params)
    counts = draw_many(logits, params, 8192, seed=1)
    drawn = set(counts.nonzero().flatten().tolist())
    support = set(probs.nonzero().flatten().tolist())
    assert drawn <= support
    # Every token with a fair chance shows up (2e-3 * 8192 = 16 expected draws).
    assert set((probs > 2e-3).nonzero().flatten().tolist()) <= drawn
    assert chi_square_excess(counts, probs) < 5.0


def test_the_chi_square_check_tells_a_wrong_temperature() -> None:
    # The check the distribution tests rely on fails for a distribution slightly off.
    logits = random_logits(600, seed=3)
    counts = draw_many(logits, SamplingParams(temperature=0.7), 8192, seed=1)
    right = expected_probs(logits, SamplingParams(temperature=0.7))
    wrong = expected_probs(logits, SamplingParams(temperature=0.8))
    assert chi_square_excess(counts, right) < 5.0
    assert chi_square_excess(counts, wrong) > 10.0


@pytest.mark.parametrize("k", [1, 7, 50, MAX_WINDOW_TOKENS, MAX_WINDOW_TOKENS + 1])
def test_top_k_keeps_exactly_k(k: int) -> None:
    # Nearly flat logits make every kept token likely to be drawn, and the next ones as
    # likely as the last kept: a cut one token off shows.
    vocab = MAX_WINDOW_TOKENS + 64
    logits = torch.linspace(1.0, 0.0, vocab)
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(k))]
    top = set(torch.topk(logits, k).indices.tolist())
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_k=k), 12 * k + 64)
    drawn = set(counts.nonzero().flatten().tolist())
    assert drawn == top  # 12 draws each on average: none missed (fixed seeds)


@pytest.mark.parametrize("nucleus", [1, 3, 40, TOP_P_WINDOW_TOKENS + 50])
def test_top_p_keeps_the_smallest_set_reaching_it(nucleus: int) -> None:
    # Mass falling geometrically: top_p set between the mass of the ``nucleus - 1`` and
    # of the ``nucleus`` most likely tokens, so exactly ``nucleus`` are needed.
    vocab = 400
    logits = -0.003 * torch.arange(vocab, dtype=torch.float32)
    logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(nucleus))]
    probs = torch.softmax(logits.double(), dim=-1)
    ranked = torch.sort(probs, descending=True)
    mass = ranked.values.cumsum(0)
    below = float(mass[nucleus - 2]) if nucleus > 1 else 0.0
    top_p = (below + float(mass[nucleus - 1])) / 2
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_p=top_p),
                       max(200, 30 * nucleus))
    drawn = set(counts.nonzero().flatten().tolist())
    assert drawn == set(ranked.indices[:nucleus].tolist())


def test_top_p_is_a_share_of_what_top_k_kept() -> None:
    # Ten tokens of about equal mass, ten more a little less likely: top-k 10 keeps the
    # ten; top_p 0.45 of their mass takes five of them (of the whole distribution, where
    # each of the ten holds ~5.8%, it would take eight).
    vocab = 1024
    logits = torch.full((vocab,), -1e9)
    logits[:10] = torch.linspace(0.0, -0.05, 10)
    logits[10:20] = -0.3
    params = SamplingParams(temperature=1.0, top_k=10, top_p=0.45)
    counts = draw_many(logits, params, 2000)
    assert set(counts.nonzero().flatten().tolist()) == set(range(5))


@pytest.mark.parametrize("top_k", [-1, 3, MAX_WINDOW_TOKENS + 100])
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-9])
def test_a_tiny_top_p_keeps_the_top_token(top_p: float, top_k: int) -> None:
    # 1e-300 is 0 in float32, and 5e-324 times what top-k keeps (under half the mass
    # here) is 0 in float64: the top token stays all the same.
    logits = torch.rand(3000, generator=torch.Generator().manual_seed(0)) * 0.5
    logits[1] = 0.9
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k), 50)
    assert int(counts[1]) == 50


def test_a_token_at_minus_infinity_is_never_drawn() -> None:
    logits = random_logits(1200, seed=5, scale=0.1)  # nearly flat
    banned = torch.arange(0, 1200, 2)
    logits[banned] = float("-inf")
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=500),
                   SamplingParams(temperature=1.0, top_p=0.99)):
        counts = draw_many(logits, params, 2400)
        assert int(counts[banned].sum()) == 0
        assert int((counts[1::2] > 0).sum()) > 400


def test_greedy_rows_are_the_argmax() -> None:
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6),
              SamplingParams(temperature=0.9)] * 5 + [SamplingParams(temperature=0.0)]
    # A sampled row without a generator is greedy too.
    generators = [make_generator(p, CPU) if i % 6 != 2 else None for i, p in enumerate(params)]
    tokens = sample_tokens(logits, params, generators)
    argmax = logits.argmax(dim=-1).tolist()
    greedy = [i for i, g in enumerate(generators) if g is None]
    assert len(greedy) == 14
    assert [tokens[i] for i in greedy] == [argmax[i] for i in greedy]


SEEDED = [
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=0.8, top_k=50, seed=12),
    SamplingParams(temperature=0.8, top_p=0.9, seed=13),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=14),
    SamplingParams(temperature=1.3, top_k=3000, top_p=0.95, seed=15),
]
OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=2),
    SamplingParams(temperature=1.0, top_k=900),
    SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=0.5, top_p=0.999),
]


def draw_steps(step_logits: list[torch.Tensor], params: list[SamplingParams],
               target: int) -> list[int | None]:
    """Row ``target``'s tokens over the steps, each generator made afresh from its seed."""
    generators = [make_generator(p, CPU) for p in params]
    return [sample_tokens(logits, params, generators)[target] for logits in step_logits]


@pytest.mark.parametrize("target", range(len(SEEDED)))
def test_a_seeded_row_draws_the_same_in_any_batch(target: int) -> None:
    vocab = 8192
    rng = random.Random(target)
    own = [random_logits(vocab, seed=100 + step, scale=3.0) for step in range(6)]
    alone = draw_steps([row[None] for row in own], [SEEDED[target]], 0)
    for trial in range(3):
        others = rng.sample(OTHERS + SEEDED[:target] + SEEDED[target + 1:], k=3 + 2 * trial)
        where = rng.randrange(len(others) + 1)
        params = [*others[:where], SEEDED[target], *others[where:]]
        batches = []
        for step, row in enumerate(own):
            rest = torch.randn(len(others), vocab,
                               generator=torch.Generator().manual_seed(1000 * trial + step))
            batches.append(torch.cat([rest[:where], row[None], rest[where:]]))
        assert draw_steps(batches, params, where) == alone, (trial, where)
    assert len(set(alone)) > 1  # it did sample


def test_a_row_with_nothing_to_draw_from_gets_no_token_and_others_are_unaffected() -> None:
    vocab = 3000
    good = [random_logits(vocab, seed=s) for s in range(3)]
    good_params = [SamplingParams(temperature=0.9, seed=1),
                   SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=2),
                   SamplingParams(temperature=0.0)]
    nan = torch.zeros(vocab)
    nan[7] = float("nan")
    all_minus_inf = torch.full((vocab,), float("-inf"))
    plus_inf = torch.zeros(vocab)
    plus_inf[3] = float("inf")
    huge = torch.full((vocab,), 3e38)  # finite, but not once divided by the temperature
    bad = [nan, all_minus_inf, plus_inf, nan, all_minus_inf, huge]
    bad_params = [SamplingParams(temperature=0.9, top_p=0.9, seed=3),
                  SamplingParams(temperature=0.9, top_k=10, seed=4),
                  SamplingParams(temperature=0.9, seed=5),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.5, seed=6)]
    expected = [draw_steps([row[None]], [p], 0)[0] for row, p in zip(good, good_params,
                                                                      strict=True)]
    assert None not in expected
    rows = [bad[0], good[0], bad[1], bad[2], good[1], bad[3], bad[4], good[2], bad[5]]
    params = [bad_params[0], good_params[0], bad_params[1], bad_params[2], good_params[1],
              bad_params[3], bad_params[4], good_params[2], bad_params[5]]
    generators = [make_generator(p, CPU) for p in params]
    tokens = sample_tokens(torch.stack(rows), params, generators)
    assert tokens == [None, expected[0], None, None, expected[1], None, None, expected[2],
                      None]


def test_mismatched_or_wrong_input_is_refused() -> None:
    logits = torch.zeros(2, 10)
    params = [SamplingParams()] * 2
    with pytest.raises(ValueError, match="2 rows of logits but 1 parameters"):
        sample_tokens(logits, params[:1], [None, None])
    with pytest.raises(ValueError, match="float32"):
        sample_tokens(logits.bfloat16(), params, [None, None])


# ---------------------------------------------------------------- in the engine
FLAGS = ("--page-size", "4", "--max-total-tokens", "2048")


def prompt(seed: int, length: int = 24) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def request(ids: list[int], **sampling: object) -> GenerateRequest:
    params = SamplingParams(**{"max_new_tokens": 16, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return GenerateRequest(tuple(ids), params)


def test_a_seeded_request_generates_the_same_alone_and_in_a_batch(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(*FLAGS)
    seeded = request(prompt(1), temperature=0.9, top_k=40, top_p=0.95, seed=7)
    alone = run_many(engine, [seeded])[0]
    others = [request(prompt(2), temperature=0.0), request(prompt(3), temperature=1.2),
              request(prompt(4), temperature=0.7, top_p=0.5, seed=3, max_new_tokens=9),
              request(prompt(5, length=40), temperature=1.0, top_k=5)]
    first = run_many(engine, [*others[:2], seeded, *others[2:]])
    last = run_many(engine, [*others, seeded])
    assert alone.last.error is None and len(alone.token_ids) == 16
    assert first[2].token_ids == alone.token_ids
    assert last[-1].token_ids == alone.token_ids
    assert all(r.last.error is None for r in first + last)
    engine.check_integrity()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_whose_logits_turn_nan_fails_alone(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, temperature: float,
) -> None:
    engine = make_engine(*FLAGS)
    others = [request(prompt(10 + i), temperature=0.8, seed=i) for i in range(3)]
    solo = [r.token_ids for r in run_many(engine, others)]
    failing_ids = prompt(20)
    real = postprocess_module.sample_tokens
    calls = 0

    def nan_on_fourth(logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None]) -> list[int | None]:
        # The failing request's row turns NaN on its 4th token (a model gone wrong).
        nonlocal calls
        rows = [i for i, p in enumerate(params) if p.max_new_tokens == 17]
        if rows:
            calls += 1
            if calls == 4:
                logits = logits.clone()
                logits[rows[0], 5] = float("nan")
        return real(logits, params, generators)

    monkeypatch.setattr(postprocess_module, "sample_tokens", nan_on_fourth)
    # Its max_new_tokens tells its row from the others'.
    failing = request(failing_ids, temperature=temperature, max_new_tokens=17)
    results = run_many(engine, [others[0], failing, *others[1:]])
    rest = [results[0], *results[2:]]
    assert [r.token_ids for r in rest] == solo
    assert all(r.last.error is None for r in rest)
    bad = results[1]
    assert bad.last.finish_reason == "abort"
    assert bad.last.error is not None and "NaN" in bad.last.error
    assert len(bad.token_ids) == 3
    engine.check_integrity()
