"""Model dirs that cannot be served fail at load time, with a message saying what is wrong.

Each case starts from a valid checkpoint written by transformers and breaks one
thing: the error names the file, field or tensors involved, so whoever points
the server at the wrong dir knows what to fix. Sharded checkpoints (index +
shards) load like single-file ones.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hicache.config import ConfigError
from hicache.model.errors import ModelConfigError
from hicache.model.loader import load_model
from hicache.model.weights import WeightLoadError
from tests.hf_checkpoints import VOCAB, hf_logits, variants, write_checkpoint
from tests.model_scenarios import SlotAllocator, new_pool, random_tokens, run_in_steps


@pytest.fixture(scope="module")
def valid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("valid")
    write_checkpoint(variants()["llama-gqa"], path)
    return path


@pytest.fixture
def model_dir(valid_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the valid checkpoint, for one test to break."""
    return Path(shutil.copytree(valid_dir, tmp_path / "model"))


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_the_valid_dir_loads(valid_dir: Path) -> None:
    loaded = load_model(valid_dir, "auto", None, "float32")
    assert loaded.config.num_layers == 2


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        load_model(tmp_path / "nowhere")


def test_no_config_json(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        load_model(model_dir)


def test_unreadable_config_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{truncated")
    with pytest.raises(ModelConfigError, match=r"config\.json: cannot be read as JSON"):
        load_model(model_dir)
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        load_model(model_dir)


def test_unsupported_architecture(model_dir: Path) -> None:
    _edit_config(model_dir, lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(
        ModelConfigError, match="unsupported architecture 'MistralForCausalLM'"
    ) as e:
        load_model(model_dir)
    assert "LlamaForCausalLM" in str(e.value)  # and what is supported


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": None}, "no 'hidden_size'"),
    ],
    ids=["activation", "sliding-window", "rope-type", "quantized", "heads", "missing-field"],
)
def test_config_fields_we_do_not_implement(
    model_dir: Path, change: dict[str, Any], message: str
) -> None:
    _edit_config(model_dir, lambda c: c.update(change))
    with pytest.raises(ModelConfigError, match=message) as e:
        load_model(model_dir)
    assert "config.json" in str(e.value)  # which file says so


def test_no_weights(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"no \.safetensors weights$"):
        load_model(model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightLoadError, match="convert them to safetensors"):
        load_model(model_dir)


def test_corrupt_weights_file(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: not a readable safetensors"):
        load_model(model_dir)


def test_missing_tensor(model_dir: Path) -> None:
    _edit_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj"):
        load_model(model_dir)


def test_unexpected_tensors(model_dir: Path) -> None:
    # A checkpoint of a deeper model than config.json says: layer 1 is left over.
    _edit_config(model_dir, lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: model\.layers\.1\.") as e:
        load_model(model_dir)
    assert "(and 1 more)" in str(e.value)  # 9 tensors of layer 1, the first 8 listed


def test_shape_mismatch(model_dir: Path) -> None:
    _edit_config(model_dir, lambda c: c.update(intermediate_size=128))
    with pytest.raises(WeightLoadError, match="wrong shapes") as e:
        load_model(model_dir)
    assert "model.layers.0.mlp.gate_proj.weight: checkpoint [96, 64], model [128, 64]" in str(
        e.value
    )


def test_byte_level_fallback_too_large_for_the_model(model_dir: Path) -> None:
    _edit_config(model_dir, lambda c: c.update(vocab_size=200))
    _edit_weights(
        model_dir,
        lambda t: t.update(
            {
                name: t[name][:200].clone()
                for name in ("model.embed_tokens.weight", "lm_head.weight")
            }
        ),
    )
    with pytest.raises(ModelConfigError, match="byte-level fallback"):
        load_model(model_dir)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(variants()["qwen3-qknorm-tied"], tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, "auto", None, "float32").model
    prompt = random_tokens(20, VOCAB, seed=1)
    pool = new_pool(model)
    got = run_in_steps(model, pool, prompt, SlotAllocator(pool).slots(20), [20])
    torch.testing.assert_close(got, hf_logits(checkpoint.hf, prompt), atol=1e-4, rtol=1e-5)

    shards[-1].unlink()
    with pytest.raises(WeightLoadError, match="shard files that are missing"):
        load_model(tmp_path)
