"""A model split over 2 (and 3) ranks computes what the same model computes alone.

Ranks are real processes (gloo over loopback, ``ranks.run_ranks``) that each build
their part of the model from the same checkpoint and run the same greedy scenario
through their own paged pool (prefill on a cached prefix, cold prefills, decode
steps; ``tp_model_ranks``). Against the single-rank model in float32: every rank
returns the full logits of every step, equal up to summation order, the same greedy
tokens exactly, and holds exactly its part of every checkpoint tensor.

Checkpoints are written by transformers (Llama GQA; Llama-3.1 RoPE with o_proj bias
and tied embeddings; Qwen2 q/k/v biases; Qwen3 q/k norm with a single KV head, which
2 or 3 ranks replicate; a SmolLM2-like 6/3 heads shape whose GQA groups split 2:1, with
an odd intermediate size and vocabulary), plus dummy weights, prepacked weights and
the real SmolLM2-135M converted from its GGUF file, when installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from hicache.model.default_model import DefaultModelMissingError, default_model_path
from tests.hf_checkpoints import variants, write_checkpoint
from tests.model_scenarios import small_qwen3_style
from tests.ranks import run_ranks
from tests.tp_model_ranks import Case, CaseResult, run_case, run_cases

# Relative to the logits' scale: fp32 products summed in another order (over ranks).
RELATIVE_ATOL = 1e-5


def _variants() -> dict[str, object]:
    shapes: dict[str, object] = dict(variants())
    # SmolLM2's head layout at test size (3 KV heads of 2 query heads: 2 ranks hold
    # 2 and 1 groups), odd MLP width and vocabulary (uneven column and row splits).
    shapes["llama-uneven"] = LlamaConfig(
        vocab_size=321, hidden_size=48, intermediate_size=97, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, num_attention_heads=6,
        num_key_value_heads=3, tie_word_embeddings=False,
    )
    return shapes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for name, config in _variants().items():
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(config, path)  # type: ignore[arg-type]
        paths[name] = path
    return paths


def _tp2_cases(checkpoints: dict[str, Path]) -> list[Case]:
    cases = [Case(name, str(path)) for name, path in checkpoints.items()]
    cases.append(Case("llama-gqa-prepacked", str(checkpoints["llama-gqa"]), prepack=True))
    tied = "llama3-rope-tied-bias"
    cases.append(Case(f"{tied}-prepacked", str(checkpoints[tied]), prepack=True))
    # Dummy weights: every rank must slice the single-rank model's random tensors.
    cases.append(Case("dummy-qwen3-style", config=small_qwen3_style(num_layers=2)))
    return cases


def _tp3_cases(checkpoints: dict[str, Path]) -> list[Case]:
    return [Case(name, str(checkpoints[name])) for name in ("llama-uneven", "qwen3-qknorm-tied")]


Results = dict[str, tuple[CaseResult, list[CaseResult]]]  # case -> (alone, per rank)


def _alone_and_ranks(cases: list[Case], size: int) -> Results:
    # Alone first: it builds the CPU attention kernel (if the cache lacks it) before the
    # ranks start, so they only load it.
    alone = {case.name: run_case(case, None) for case in cases}
    ranks = run_ranks(run_cases, size, cases)
    return {name: (alone[name], [r[name] for r in ranks]) for name in alone}


@pytest.fixture(scope="module")
def tp2(checkpoints: dict[str, Path]) -> Results:
    return _alone_and_ranks(_tp2_cases(checkpoints), 2)


@pytest.fixture(scope="module")
def tp3(checkpoints: dict[str, Path]) -> Results:
    return _alone_and_ranks(_tp3_cases(checkpoints), 3)


def assert_same_run(alone: CaseResult, ranks: list[CaseResult]) -> None:
    for rank, result in enumerate(ranks):
        assert result.tokens == alone.tokens, f"rank {rank}"
        assert len(result.logits) == len(alone.logits)
        for step, (got, expected) in enumerate(zip(result.logits, alone.logits, strict=True)):
            assert got.dtype == torch.float32 and got.shape == expected.shape, (rank, step)
            scale = float(expected.abs().max())
            assert expected.std() > 0.05 * scale  # the logits differ between tokens
            torch.testing.assert_close(
                got, expected, atol=RELATIVE_ATOL * scale, rtol=0,
                msg=lambda m, where=(rank, step): f"rank, step {where}: {m}",
            )
    for rank, result in enumerate(ranks):
        rank_kv_heads, whole_kv_heads = result.kv_heads
        assert 1 <= rank_kv_heads <= whole_kv_heads
        if rank_kv_heads < whole_kv_heads:  # a pool of all KV heads is refused
            assert "does not fit the model" in (result.whole_pool_error or ""), rank
    # The ranks agree with each other exactly: the sums over ranks reach every rank alike.
    for result in ranks[1:]:
        for got, first in zip(result.logits, ranks[0].logits, strict=True):
            assert torch.equal(got, first)


def assert_holds_its_parts(alone: CaseResult, ranks: list[CaseResult]) -> None:
    """Each rank holds exactly its part of each tensor; together they cover it."""
    for name, (whole, _, _) in alone.weights.items():
        parts = [result.weights[name] for result in ranks]
        if all(dim is None for _, dim, _ in parts):  # replicated: whole on every rank
            assert all(torch.equal(part, whole) for part, _, _ in parts), name
            continue
        split_dim = parts[0][1]
        assert split_dim is not None and all(dim == split_dim for _, dim, _ in parts), name
        covered = torch.zeros(whole.shape[split_dim], dtype=torch.bool)
        for rank, (part, _, start) in enumerate(parts):
            size = part.shape[split_dim]
            assert torch.equal(part, whole.narrow(split_dim, start, size)), (name, rank)
            covered[start : start + size] = True
        assert covered.all(), name


@pytest.mark.parametrize(
    "name",
    [*_variants(), "llama-gqa-prepacked", "llama3-rope-tied-bias-prepacked",
     "dummy-qwen3-style"],
)
def test_tp2_equals_one_rank(tp2: Results, name: str) -> None:
    alone, ranks = tp2[name]
    assert_same_run(alone, ranks)
    assert_holds_its_parts(alone, ranks)


@pytest.mark.parametrize("name", ["llama-uneven", "qwen3-qknorm-tied"])
def test_tp3_equals_one_rank(tp3: Results, name: str) -> None:
    alone, ranks = tp3[name]
    assert_same_run(alone, ranks)
    assert_holds_its_parts(alone, ranks)


def test_smollm2_gguf_tp2_equals_one_rank(smollm2_dir: Path) -> None:
    case = Case("smollm2", str(smollm2_dir), keep_weights=False)
    alone = run_case(case, None)
    ranks = run_ranks(run_cases, 2, [case])
    assert_same_run(alone, [r["smollm2"] for r in ranks])


@pytest.fixture(scope="module")
def smollm2_dir(request: pytest.FixtureRequest) -> Path:
    try:
        default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    converted = request.getfixturevalue("smollm2")
    return Path(converted.path)


@pytest.mark.slow
def test_tp2_compiled_blocks_equal_one_rank_eager() -> None:
    """Each rank compiles its blocks (the halves around its sums over ranks)."""
    config = small_qwen3_style(num_layers=2)
    alone = run_case(Case("eager", config=config, keep_weights=False), None)
    compiled = Case("compiled", config=config, compile=True, keep_weights=False)
    ranks = run_ranks(run_cases, 2, [compiled])
    assert_same_run(alone, [r["compiled"] for r in ranks])
