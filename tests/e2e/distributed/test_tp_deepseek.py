"""DeepSeek-V2/V3 split over 2 and 3 ranks compute what the model computes alone.

The greedy scenario of ``tp_model_ranks`` (a prefill on a cached prefix next to cold
prefills, batched decodes, a lone decode) on transformers-written DeepSeek checkpoints
and on dummy weights: MLA heads split over the ranks, the latent (kv_a_proj_with_mqa,
kv_a_layernorm) replicated so every rank's pool holds the whole latent, the experts'
and the dense FFN's columns split, o_proj and down projections summed over the ranks.
Three ranks split 4 heads 2:1:1 and 32 expert columns 11:11:10.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.model.config import ModelConfig
from tests.deepseek_checkpoints import deepseek_variants, write_deepseek
from tests.e2e.distributed.test_tp_model import assert_holds_its_parts, assert_same_run
from tests.ranks import run_ranks
from tests.tp_model_ranks import Case, CaseResult, run_case, run_cases

Results = dict[str, tuple[CaseResult, list[CaseResult]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for name in ("v2-lite", "v3"):
        path = tmp_path_factory.mktemp(name)
        write_deepseek(deepseek_variants()[name], path)
        paths[name] = path
    return paths


def _dummy_config() -> ModelConfig:
    raw = deepseek_variants()["v2-group"].to_dict()
    raw["architectures"] = ["DeepseekV2ForCausalLM"]
    raw["dtype"] = "float32"
    return ModelConfig.from_hf_dict(raw)


def _run(cases: list[Case], size: int) -> Results:
    alone = {case.name: run_case(case, None) for case in cases}
    ranks = run_ranks(run_cases, size, cases)
    return {name: (alone[name], [r[name] for r in ranks]) for name in alone}


@pytest.fixture(scope="module")
def tp2(checkpoints: dict[str, Path]) -> Results:
    cases = [Case(name, str(path)) for name, path in checkpoints.items()]
    # Dummy weights: every rank must slice the single-rank model's random experts.
    cases.append(Case("dummy-v2-group", config=_dummy_config()))
    return _run(cases, 2)


@pytest.mark.parametrize("name", ["v2-lite", "v3", "dummy-v2-group"])
def test_tp2_equals_one_rank(tp2: Results, name: str) -> None:
    alone, ranks = tp2[name]
    assert_same_run(alone, ranks)
    assert_holds_its_parts(alone, ranks)
    # The latent is replicated: every rank's pool is the whole model's.
    assert all(result.kv_heads == (1, 1) for result in ranks)


def test_tp3_uneven_equals_one_rank(checkpoints: dict[str, Path]) -> None:
    results = _run([Case("v3", str(checkpoints["v3"]))], 3)
    alone, ranks = results["v3"]
    assert_same_run(alone, ranks)
    assert_holds_its_parts(alone, ranks)
