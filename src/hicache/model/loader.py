"""load_model: a ready CausalLM, its config and its tokenizer, from a model dir or a preset.

- ``load_format="auto"``: ``model_path`` is a Hugging Face model dir (config.json,
  safetensors weights, tokenizer.json); weights stream straight onto ``device``.
  It may also be a GGUF file: converted once into a model dir in the local cache
  (``hicache.model.gguf_cache``), which is then loaded like any other.
- ``load_format="dummy"``: seeded random weights, with the shape of ``model_path``'s
  config.json when given, else of ``preset`` (default "tiny"); the tokenizer is
  the dir's tokenizer.json if it has one, else the byte-level fallback.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import NamedTuple

import torch

from hicache.config import ConfigError
from hicache.distributed.group import TPGroup
from hicache.model.config import ModelConfig, parse_dtype
from hicache.model.errors import ModelConfigError
from hicache.model.gguf import is_gguf_file
from hicache.model.gguf_cache import gguf_serving_dtype, prepare_gguf
from hicache.model.model import CausalLM
from hicache.model.presets import DEFAULT_PRESET, get_preset
from hicache.model.weights import init_dummy_weights, load_safetensors
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.load import load_tokenizer


class LoadFormat(str, Enum):
    AUTO = "auto"  # real weights from model_path
    DUMMY = "dummy"  # seeded random weights


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer


def load_model(
    model_path: str | Path | None = None,
    load_format: LoadFormat | str = LoadFormat.AUTO,
    preset: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Build, fill and return the model; ``dtype`` None or "auto" keeps the config's.

    ``tp``: build this rank's part of a tensor-parallel model (every rank calls this
    with the same arguments); its pool geometry is ``model.kv_geometry()``.
    """
    fmt = _load_format(load_format)
    if model_path is not None and preset is not None:
        raise ConfigError("give either --model-path or a model preset, not both")
    if model_path is not None:
        model_path = resolve_model_dir(model_path, dtype, device).path
    if fmt is LoadFormat.AUTO and model_path is None:
        raise ConfigError(
            "--model-path is required to load real weights; use --load-format dummy "
            "(with a preset) to run without a checkpoint"
        )
    if model_path is not None:
        config = ModelConfig.from_pretrained(model_path)
    else:
        config = get_preset(preset or DEFAULT_PRESET)
    if dtype is not None and dtype != "auto":
        config = config.with_dtype(parse_dtype(dtype))

    model = CausalLM(config, device=device, tp=tp)
    if fmt is LoadFormat.AUTO:
        assert model_path is not None
        load_safetensors(model, model_path)
    else:
        init_dummy_weights(model, seed=seed)
    model.eval()

    extra_eos = config.eos_token_ids + _generation_eos_ids(model_path)
    tokenizer = load_tokenizer(model_path, extra_eos_token_ids=extra_eos)
    if tokenizer.vocab_size > config.vocab_size:
        why = (
            " (the byte-level fallback: the model dir has no tokenizer.json)"
            if isinstance(tokenizer, ByteTokenizer)
            else ""
        )
        raise ModelConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens{why} but the model only "
            f"{config.vocab_size}: they do not belong together"
        )
    return LoadedModel(model, config, tokenizer)


class ModelDir(NamedTuple):
    path: Path
    name: str  # what the model is called by default: the dir's or the GGUF file's name


def resolve_model_dir(
    model_path: str | Path, dtype: str | torch.dtype | None, device: torch.device | str
) -> ModelDir:
    """``--model-path`` as a model dir: itself, or for a GGUF file its conversion in the
    local cache (made now if the cache lacks it) in the dtype it will be served in."""
    path = Path(model_path)
    if is_gguf_file(path):
        converted = prepare_gguf(path, gguf_serving_dtype(dtype, device))
        return ModelDir(converted.path, converted.name)
    if not path.is_dir():
        raise ConfigError(f"--model-path {model_path}: not a directory or a GGUF file")
    return ModelDir(path, path.name)


def _load_format(value: LoadFormat | str) -> LoadFormat:
    try:
        return LoadFormat(value)
    except ValueError:
        choices = ", ".join(f.value for f in LoadFormat)
        raise ConfigError(f"--load-format {value!r}: choose one of {choices}") from None


def _generation_eos_ids(model_path: str | Path | None) -> tuple[int, ...]:
    """Stop ids from generation_config.json (instruct models list their end-of-turn ids there)."""
    if model_path is None:
        return ()
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return ()
    with path.open() as f:
        value = json.load(f).get("eos_token_id")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()
