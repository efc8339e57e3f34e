"""Filling a CausalLM: safetensors checkpoints by Hugging Face names, or dummy weights.

Loading is streamed: the model already exists (empty) on its device, and each
checkpoint tensor is read from its memory-mapped file and copied into place
before the next is read, so peak memory is the model plus one tensor, not two
models. Every name and shape is checked against the model before any data is
read: a wrong checkpoint fails at once with the offending names, never
half-loaded. A tensor-parallel rank reads only its part of each tensor
(``safe_open(...).get_slice``), so a rank's peak is its shard plus one slice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from hicache.model.model import CausalLM
from hicache.model.norm import RMSNorm
from hicache.model.parameter import WeightShard

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
    """Copy every tensor of the checkpoint at ``model_path`` (the rank's part of it, under
    tensor parallelism) into ``model``."""
    from safetensors import safe_open

    files = checkpoint_files(model_path)
    targets = model.hf_shards()
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
                        shard = targets[name]
                        values = (
                            f.get_tensor(name)
                            if shard.dim is None
                            else f.get_slice(name)[shard.index()]
                        )
                        # copy_ converts dtype and moves to the model's device in one go.
                        shard.target.copy_(values)


def _check_names_and_shapes(
    model: CausalLM, targets: dict[str, WeightShard], shapes: dict[str, tuple[int, ...]]
) -> None:
    ignored = {n for n in shapes if n.endswith(_IGNORED_SUFFIXES)}
    config = model.config
    # Layers the checkpoint has past the ones served (DeepSeek-V3's multi-token prediction).
    extra = tuple(
        f"model.layers.{index}."
        for index in range(config.num_layers, config.num_layers + config.extra_checkpoint_layers)
    )
    if extra:
        ignored |= {n for n in shapes if n.startswith(extra)}
    if model.config.tie_word_embeddings:
        # Some tied checkpoints also store the (identical) output projection.
        ignored.add("lm_head.weight")
    missing = sorted(set(targets) - set(shapes))
    unexpected = sorted(set(shapes) - set(targets) - ignored)
    mismatched = [
        f"{name}: checkpoint {list(shapes[name])}, model {list(target.full_shape)}"
        for name, target in targets.items()
        if name in shapes and shapes[name] != target.full_shape
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

    Under tensor parallelism every rank draws each whole parameter, exactly as a
    single-rank model does, and keeps its part: the ranks together hold the
    single-rank model's weights, at the cost of drawing (and briefly holding, one
    parameter at a time) the whole model on every rank.
    """
    generator = torch.Generator(device=model.device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    shards = list(model.hf_shards().values())
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
                continue
            pieces = _pieces_of(param, shards)
            if all(piece.dim is None for piece in pieces):
                param.normal_(0.0, std, generator=generator)
                continue
            _draw_whole_keep_part(pieces, std, generator)


def _pieces_of(param: torch.Tensor, shards: list[WeightShard]) -> list[WeightShard]:
    """The shards whose targets are views of ``param``, in their order within it: a
    fused parameter stacks its checkpoint tensors (q, k, v; gate, up) along dim 0."""
    storage = param.untyped_storage().data_ptr()
    pieces = [s for s in shards if s.target.untyped_storage().data_ptr() == storage]
    if not pieces:
        raise WeightLoadError(f"a parameter of shape {list(param.shape)} has no checkpoint name")
    return sorted(pieces, key=lambda s: s.target.storage_offset())


def _draw_whole_keep_part(
    pieces: list[WeightShard], std: float, generator: torch.Generator
) -> None:
    """Draw the single-rank parameter that ``pieces`` are parts of, and copy each part."""
    first = pieces[0]
    rows = sum(piece.full_shape[0] for piece in pieces)
    whole = torch.empty(
        (rows, *first.full_shape[1:]), device=first.target.device, dtype=first.target.dtype
    ).normal_(0.0, std, generator=generator)
    at = 0
    for piece in pieces:
        piece.target.copy_(piece.take(whole.narrow(0, at, piece.full_shape[0])))
        at += piece.full_shape[0]
