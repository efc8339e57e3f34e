"""Session-wide test settings and fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.local_cache import CACHE_DIR_ENV
from hicache.model.default_model import default_model_path
from hicache.model.gguf_cache import ConvertedModel, prepare_gguf


@pytest.fixture(autouse=True, scope="session")
def _private_local_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never write into the user's cache dir (weight digests, default L3 pages);
    servers started as child processes inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("local-cache")))
        yield


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> ConvertedModel:
    """The default model (SmolLM2-135M-Instruct GGUF) converted to float32 once per session,
    into a cache dir of its own: point ``HICACHE_CACHE_DIR`` at ``path.parent.parent`` and
    anything loading the GGUF in float32 on CPU finds the conversion there."""
    root = tmp_path_factory.mktemp("hicache-cache")
    return prepare_gguf(default_model_path(), torch.float32, root)
