"""A model dir without tokenizer.json still stops where its config says generation ends.

Such a dir is served with the byte-level tokenizer. The checkpoint (written by
transformers) has no tokenizer; its greedy answer is taken from transformers,
and the id it produces a few tokens in is declared the model's end-of-sequence
id in config.json or in generation_config.json. The engine must stop right
there, on that id, and not on the byte tokenizer's own specials (ordinary
tokens of this model).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.engine.engine import Engine
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.engine_helpers import run
from tests.hf_checkpoints import VOCAB, hf_greedy_decode, variants, write_checkpoint
from tests.model_scenarios import random_tokens

STEPS = 12


def set_eos(path: Path, eos: int | None) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["eos_token_id"] = eos
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("named_in", ["config.json", "generation_config.json"])
def test_the_models_eos_id_stops_generation(
    make_engine: Callable[..., Engine], tmp_path: Path, named_in: str
) -> None:
    checkpoint = write_checkpoint(variants()["llama-gqa"], tmp_path / "model")
    assert not (checkpoint.path / "tokenizer.json").exists()
    prompt = random_tokens(20, VOCAB, seed=3)
    greedy, _ = hf_greedy_decode(checkpoint.hf, prompt, STEPS)
    # The first token, past the second, not seen before: the answer reaches it once.
    stop_at = next(i for i in range(2, STEPS) if greedy[i] not in greedy[:i])
    eos = greedy[stop_at]
    set_eos(checkpoint.path / "config.json", eos if named_in == "config.json" else None)
    set_eos(checkpoint.path / "generation_config.json",
            eos if named_in == "generation_config.json" else None)

    engine = make_engine("--model-path", str(checkpoint.path))
    assert isinstance(engine.tokenizer, ByteTokenizer)
    answer = run(engine, prompt, max_new_tokens=STEPS)
    assert answer.last.finish_reason == "stop"
    assert answer.token_ids == greedy[: stop_at + 1]
    # Past the model's own stop, the whole answer comes (the specials stop nothing here).
    whole = run(engine, prompt, max_new_tokens=STEPS, ignore_eos=True)
    assert whole.token_ids == greedy
    assert whole.last.finish_reason == "length"
