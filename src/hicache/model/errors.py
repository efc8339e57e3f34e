"""The model layer's configuration errors, importable without torch.

They live apart from ``config.py`` (which needs torch for dtypes) because the
tokenizer package raises ``GGUFError`` while rebuilding a GGUF file's tokenizer,
and that package, like ``hicache router`` which uses it, never imports torch.
Both are ``ConfigError``: the server reports them as a start-up problem of the
model it was given, not as a crash.
"""

from __future__ import annotations

from hicache.config import ConfigError


class ModelConfigError(ConfigError):
    """A model config we cannot serve; the message names the field and what is supported."""


class GGUFError(ModelConfigError):
    """A GGUF file we cannot serve; the message names the key, tensor or type at fault."""
