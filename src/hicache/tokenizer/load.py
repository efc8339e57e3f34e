"""Which tokenizer a model dir gets: its tokenizer.json, else the byte-level fallback."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.hf import HFTokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(
    model_path: str | Path | None, extra_eos_token_ids: Iterable[int] = ()
) -> Tokenizer:
    """The model dir's tokenizer.json, or the byte-level fallback when there is none."""
    if model_path is not None and (Path(model_path) / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(model_path, extra_eos_token_ids)
    if model_path is not None:
        logger.warning("%s has no tokenizer.json: using the byte-level tokenizer", model_path)
    return ByteTokenizer(eos_token_ids=extra_eos_token_ids)
