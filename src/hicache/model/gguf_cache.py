"""A GGUF file converted once into a model dir in the local cache, then loaded from there.

Converting (dequantizing every weight, rebuilding the tokenizer) takes seconds
to minutes. The result is an ordinary Hugging Face style model dir
(config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template) under
``$HICACHE_CACHE_DIR/models/<name>-<dtype>-<digest>/``, which the model-dir
loader reads as fast as any checkpoint. The digest covers the file's bytes
(xxh3-128, at memory speed) and the converter's version: a changed file, or a
fix to the converter, converts again; a restart finds the earlier conversion.

The dir appears by renaming a finished temporary dir, so a conversion that
crashed or was interrupted is never loaded; the next conversion of the same
file removes what a dead one left behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from hicache.local_cache import local_cache_dir
from hicache.model.config import dtype_name, parse_dtype
from hicache.model.errors import GGUFError
from hicache.model.gguf import GGUFModel
from hicache.model.model import CausalLM
from hicache.model.safetensors_writer import SafetensorsWriter
from hicache.tokenizer.gguf import GGUFTokenizerFiles

logger = logging.getLogger(__name__)

# Bump when a conversion's output changes: older conversions are then redone.
CONVERTER_VERSION = 1
# Written last into a conversion: where it came from (and, read by the model identity,
# which bytes it came from: two GGUFs of one shape never share L3 pages).
SOURCE_FILE = "hicache_gguf.json"
_READ_CHUNK_BYTES = 16 << 20
_DIGEST_CHARS = 16
_HOST_TAG = format(zlib.crc32(socket.gethostname().encode()), "08x")
# "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": a quantization tag at the end
# of the file name says how the file stores the weights, not which model it is.
_QUANT_TAG = re.compile(r"[.\-_](?:I?Q\d\w*|TQ\d\w*|MXFP4\w*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True)
class ConvertedModel:
    path: Path  # the model dir
    name: str  # the model's name for clients
    converted: bool  # False: an earlier conversion was found in the cache


def gguf_serving_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The dtype to dequantize to. ``auto`` (a GGUF has none once dequantized): bfloat16 on
    a GPU, float32 on the CPU, whose kernels are faster in float32 and where it keeps every
    dequantized value exact."""
    if dtype is not None and dtype != "auto":
        return parse_dtype(dtype)
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def gguf_model_name(path: str | Path) -> str:
    stem = Path(path).name.removesuffix(".gguf")
    return _QUANT_TAG.sub("", stem) or stem


def file_digest(path: Path) -> str:
    """Hex xxh3-128 of the converter version and the file's bytes."""
    digest = xxhash.xxh3_128(f"hicache-gguf-v{CONVERTER_VERSION}:".encode())
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_gguf(
    gguf_path: str | Path, dtype: torch.dtype, root: Path | None = None
) -> ConvertedModel:
    """The converted model dir of ``gguf_path`` in ``dtype``: found, or made now."""
    source = Path(gguf_path)
    name = gguf_model_name(source)
    digest = file_digest(source)
    models = (root if root is not None else local_cache_dir()) / "models"
    target = models / f"{name}-{dtype_name(dtype)}-{digest[:_DIGEST_CHARS]}"
    if (target / SOURCE_FILE).is_file():
        return ConvertedModel(target, name, converted=False)
    models.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(models, target.name)
    temporary = models / f".tmp-{target.name}-{_HOST_TAG}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    started = time.monotonic()
    logger.info("converting %s to %s (once: later starts load the result)", source, target)
    try:
        _convert(source, temporary, dtype, digest)
        try:
            temporary.rename(target)
        except OSError:
            if (target / SOURCE_FILE).is_file():
                # Another process finished the same conversion first; theirs is as good.
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                # A dir of that name without the file written last is not a conversion
                # of ours (emptied by hand, say): ours replaces it.
                shutil.rmtree(target)
                temporary.rename(target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", source.name, time.monotonic() - started)
    return ConvertedModel(target, name, converted=True)


def _convert(source: Path, out: Path, dtype: torch.dtype, digest: str) -> None:
    gguf = GGUFModel(source)
    config = gguf.config(dtype)
    tokenizer = GGUFTokenizerFiles.from_metadata(gguf.metadata)
    tensors = gguf.tensors()
    # Names and shapes against the model they will fill, before any tensor is dequantized.
    empty = CausalLM(config, device="meta")  # shapes only, no memory
    expected = {name: tuple(view.shape) for name, view in empty.hf_weights().items()}
    found = {t.hf_name: t.shape for t in tensors}
    problems = sorted(
        [f"missing {name}" for name in expected.keys() - found.keys()]
        + [f"unexpected {t.gguf_name}" for t in tensors if t.hf_name not in expected]
        + [
            f"{t.gguf_name} is {list(t.shape)}, the config says {list(expected[t.hf_name])}"
            for t in tensors
            if t.hf_name in expected and expected[t.hf_name] != t.shape
        ]
    )
    if problems:
        raise GGUFError(f"{source}: tensors do not fit the model its metadata describes: "
                        + "; ".join(problems[:6]))
    gguf.check_types()

    _write_json(out / "config.json", config.to_hf_dict())
    _write_json(out / "generation_config.json", tokenizer.generation_config)
    _write_json(out / "tokenizer_config.json", tokenizer.tokenizer_config)
    (out / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    layout = [(t.hf_name, t.shape) for t in tensors]
    with SafetensorsWriter(out / "model.safetensors", layout, dtype) as writer:
        for info, values in gguf.weights(config):
            writer.write(info.hf_name, values)
    _write_json(out / SOURCE_FILE, {
        "source_file": source.name,
        "xxh3_128": digest,
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype_name(dtype),
    })


def _write_json(path: Path, value: object) -> None:
    with path.open("w") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())


def _remove_dead_temporaries(models: Path, target_name: str) -> None:
    """Temporaries of this target left by processes of this host that no longer run."""
    prefix = f".tmp-{target_name}-{_HOST_TAG}-"
    for path in models.glob(f"{prefix}*"):
        pid_text = path.name.removeprefix(prefix)
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
