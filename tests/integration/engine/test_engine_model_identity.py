"""Two checkpoints of one shape never read each other's KV from a shared L3.

Two random models of the same transformers config (other seeds: same files,
same sizes, other bytes) are written with ``save_pretrained`` either one over
the other into one directory, or into two directories of the same name. An
engine serves each in turn over one file L3 directory. Each model's greedy
answer must be transformers' own for that model, and the second model must
take nothing from L3 that the first one stored there, while a restart of the
second model does hit its own pages (the L3 works; the namespaces differ).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.engine.engine import Engine
from tests.engine_helpers import run
from tests.hf_checkpoints import (
    VOCAB,
    Checkpoint,
    hf_greedy_decode,
    variants,
    write_checkpoint,
)
from tests.model_scenarios import random_tokens

PAGE = 16
PROMPT_LEN = 100  # past the prefetch threshold below; 6 whole pages before the last token
STEPS = 8


def l3_flags(model_dir: Path, l3_dir: Path) -> tuple[str, ...]:
    config = {"path": str(l3_dir), "prefetch_threshold": 32}
    return (
        "--model-path", str(model_dir), "--page-size", str(PAGE), "--max-total-tokens", "1024",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    )


def serve_once(
    make_engine: Callable[..., Engine], checkpoint: Checkpoint, l3_dir: Path, prompt: list[int]
) -> tuple[list[int], int]:
    """One engine over ``checkpoint``: its greedy answer and the prompt tokens L3 gave it."""
    engine = make_engine(*l3_flags(checkpoint.path, l3_dir))
    answer = run(engine, prompt, max_new_tokens=STEPS, ignore_eos=True)
    assert engine.flush_cache()  # waits for the L3 backups
    engine.shutdown()
    return answer.token_ids, answer.last.cached_tokens.storage


@pytest.mark.parametrize("layout", ["one_dir_rewritten", "two_dirs_same_name"])
def test_models_of_one_shape_never_share_l3_pages(
    make_engine: Callable[..., Engine], tmp_path: Path, layout: str
) -> None:
    config = variants()["llama-gqa"]
    l3_dir = tmp_path / "l3"
    prompt = random_tokens(PROMPT_LEN, VOCAB, seed=5)
    reusable = (PROMPT_LEN - 1) // PAGE * PAGE

    first_dir = tmp_path / "a" / "model"
    first = write_checkpoint(config, first_dir, seed=1)
    expected_first, _ = hf_greedy_decode(first.hf, prompt, STEPS)
    answer, from_l3 = serve_once(make_engine, first, l3_dir, prompt)
    assert (answer, from_l3) == (expected_first, 0)
    assert list(l3_dir.rglob("*.*m")), "the first model stored no pages in L3"

    second_dir = first_dir if layout == "one_dir_rewritten" else tmp_path / "b" / "model"
    second = write_checkpoint(config, second_dir, seed=2)
    weights = sorted(p.name for p in second_dir.iterdir())
    assert weights == sorted(p.name for p in first_dir.iterdir())
    assert (first_dir / "model.safetensors").stat().st_size == \
        (second_dir / "model.safetensors").stat().st_size
    expected_second, _ = hf_greedy_decode(second.hf, prompt, STEPS)
    assert expected_second != expected_first  # the models differ where it shows
    answer, from_l3 = serve_once(make_engine, second, l3_dir, prompt)
    assert from_l3 == 0, "the second model read the first one's KV from L3"
    assert answer == expected_second

    # Restarted, the second model finds its own pages: the zero above was no broken L3.
    answer, from_l3 = serve_once(make_engine, second, l3_dir, prompt)
    assert (answer, from_l3) == (expected_second, reusable)
