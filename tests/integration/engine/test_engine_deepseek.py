"""DeepSeek (MLA + MoE) through the engine: cold answers are transformers' greedy tokens,
and answers from L1, L2 and L3 equal cold ones, for every host layout and I/O backend.

The pool, host pool, transfers and L3 pages hold one latent row per token per layer
(the MLA geometry); the model reads them back in the absorbed form for decodes and
the expanded form for prompts on a cached prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import PretrainedConfig

from hicache.engine.engine import Engine
from tests.deepseek_checkpoints import deepseek_variants, write_deepseek
from tests.engine_helpers import run
from tests.hf_checkpoints import Checkpoint, hf_greedy_decode
from tests.integration.engine.test_engine_cache_reuse import (
    PROMPT_LEN,
    check_tiers_equal_cold,
    l3_flags,
    prompt,
)


def _long_context(name: str) -> PretrainedConfig:
    """The test variant with room for the engine tests' 300-token prompts."""
    config = deepseek_variants()[name]
    config.max_position_embeddings = 1024
    if config.rope_parameters.get("rope_type") == "yarn":
        config.rope_parameters["original_max_position_embeddings"] = 128  # factor 8 still
    return config


@pytest.fixture(scope="module", params=["v2-lite", "v3"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    return write_deepseek(_long_context(request.param), tmp_path_factory.mktemp(request.param))


def _model_flags(checkpoint: Checkpoint) -> tuple[str, ...]:
    return ("--model-path", str(checkpoint.path), "--dtype", "float32")


def test_cold_answer_is_transformers_greedy(
    make_engine: Callable[..., Engine], checkpoint: Checkpoint
) -> None:
    engine = make_engine(*_model_flags(checkpoint), "--page-size", "16")
    ids = prompt(4, 60)
    expected, _ = hf_greedy_decode(checkpoint.hf, ids, 8)
    assert run(engine, ids, ignore_eos=True).token_ids == expected


@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_l1_l2_l3_hits_equal_cold(
    make_engine: Callable[..., Engine], checkpoint: Checkpoint, tmp_path: Path, layout: str,
    io: str,
) -> None:
    assert PROMPT_LEN < 1024
    engine = make_engine(*_model_flags(checkpoint), *l3_flags(tmp_path / "l3", layout, io))
    check_tiers_equal_cold(engine)
