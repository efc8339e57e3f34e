"""Session-wide test settings and shared fixtures: a private local cache dir, the whole run
in a private network namespace where possible (see tests/network_namespace.py for why: the
Mooncake client listens on every interface, and what happens where it is not possible), and
the default model converted once.

Tests live in tiers, one directory each, and every test carries its tier's marker (added
here from its path, so ``-m unit`` and ``tests/unit`` select the same tests):
tests/unit (pure and in-process: no subprocess, no engine running a model, no HTTP server),
tests/integration (an engine or server in process, real files, loopback HTTP), tests/e2e
(subprocesses, clusters, external stores). tests/gpu holds the tests that need CUDA.
Shared helpers are the modules at tests/*.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
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


TESTS_ROOT = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = item.path.resolve().relative_to(TESTS_ROOT).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(tier)


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
