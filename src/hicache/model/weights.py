"""Filling a CausalLM: safetensors checkpoints by Hugging Face names, or dummy weights.

Loading is streamed: the model already exists (empty) on its device, and each
checkpoint tensor is read from its memory-mapped file and copied into place
before the next is read, so peak memory is the model plus one tensor, not two
models. Every name and shape is checked against the model before any data is
read: a wrong checkpoint fails at once with the offending names, never
half-loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from hicache.model.model import CausalLM
from hicache.model.norm import RMSNorm

# Non-weight tensors some older checkpoints carry: recomputed from the config instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_NAMES_SHOWN = 8


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message lists the offending tensors."""


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a model dir: sharded (per the index), single, or all found."""
    root = Path(model_path)
    index = root / _INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise WeightLoadError(f"{index} names shard files that are missing: {missing}")
        return files
    if (root / _SINGLE_FILE).is_file():
        return [root / _SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = f" (found {others[:3]}: convert them to safetensors)" if others else ""
    raise WeightLoadError(f"{root}: no .safetensors weights{hint}")


def load_safetensors(model: CausalLM, model_path: str | Path) -> None:
    """Copy every tensor of the checkpoint at ``model_path`` into ``model``."""
    from safetensors import safe_open

    files = checkpoint_files(model_path)
    targets = model.hf_weights()
    shapes: dict[str, tuple[int, ...]] = {}
    located: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    located[name] = path
        except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
            raise WeightLoadError(f"{path}: not a readable safetensors file ({e})") from e
    _check_names_and_shapes(model, targets, shapes)
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name in targets and located[name] == path:
                        # copy_ converts dtype and moves to the model's device in one go.
                        targets[name].copy_(f.get_tensor(name))


def _check_names_and_shapes(
    model: CausalLM, targets: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> None:
    ignored = {n for n in shapes if n.endswith(_IGNORED_SUFFIXES)}
    if model.config.tie_word_embeddings:
        # Some tied checkpoints also store the (identical) output projection.
        ignored.add("lm_head.weight")
    missing = sorted(set(targets) - set(shapes))
    unexpected = sorted(set(shapes) - set(targets) - ignored)
    mismatched = [
        f"{name}: checkpoint {list(shapes[name])}, model {list(target.shape)}"
        for name, target in targets.items()
        if name in shapes and shapes[name] != tuple(target.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_some(unexpected)}")
    if mismatched:
        problems.append(f"wrong shapes: {_some(mismatched)}")
    if problems:
        arch = model.config.architecture.value
        raise WeightLoadError(
            f"checkpoint does not match {arch} as configured by config.json; " + "; ".join(problems)
        )


def _some(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return f"{shown} (and {more} more)" if more > 0 else shown


def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights for ``--load-format dummy``.

    Norm weights are 1 and everything else is N(0, std^2): activations keep unit
    scale through the residual stream, so logits are finite and differ from token
    to token, which is all tests and benchmarks need from a model that says nothing.
    """
    generator = torch.Generator(device=model.device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
