"""Session-wide test settings and shared fixtures: a private local cache dir, the whole run
in a private network namespace where possible (see tests/network_namespace.py for why: the
Mooncake client listens on every interface, and what happens where it is not possible), and
the default model converted once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from hicache.local_cache import CACHE_DIR_ENV
from tests.network_namespace import enter_private_network


def pytest_configure(config: pytest.Config) -> None:
    # Here, before test modules are imported: no test socket or library thread exists yet,
    # so everything the tests start lives in the new namespace.
    enter_private_network()


def pytest_report_header(config: pytest.Config) -> str:
    return f"network: {enter_private_network().note}"


if TYPE_CHECKING:
    from hicache.model.gguf_cache import ConvertedModel


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
    # Imported here: the network namespace is entered (pytest_configure) before torch
    # or anything else can start a thread.
    import torch

    from hicache.model.default_model import default_model_path
    from hicache.model.gguf_cache import prepare_gguf

    root = tmp_path_factory.mktemp("hicache-cache")
    return prepare_gguf(default_model_path(), torch.float32, root)
