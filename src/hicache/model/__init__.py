"""The model layer: Llama / Qwen2 / Qwen3 decoders over the paged KV pool, weights, tokenizers.

Entry points: ``load_model`` (model + config + tokenizer, from a model dir, a GGUF
file converted once into the local cache, or a preset), ``CausalLM.forward``
(one engine step over a ``ForwardBatch``), ``IncrementalDetokenizer`` (streaming text).
"""

from __future__ import annotations

from hicache.model.batch import BatchError, ForwardBatch
from hicache.model.config import Architecture, ModelConfig, ModelConfigError, parse_dtype
from hicache.model.detokenizer import IncrementalDetokenizer
from hicache.model.gguf import GGUFError
from hicache.model.loader import LoadedModel, LoadFormat, load_model
from hicache.model.model import CausalLM
from hicache.model.presets import PRESETS, get_preset
from hicache.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError
from hicache.model.weights import WeightLoadError

__all__ = [
    "PRESETS",
    "Architecture",
    "BatchError",
    "ByteTokenizer",
    "CausalLM",
    "ForwardBatch",
    "GGUFError",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "LoadFormat",
    "LoadedModel",
    "ModelConfig",
    "ModelConfigError",
    "Tokenizer",
    "TokenizerError",
    "WeightLoadError",
    "get_preset",
    "load_model",
    "parse_dtype",
]
