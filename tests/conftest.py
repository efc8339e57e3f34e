"""Session-wide test settings: a private local cache dir, and the whole run in a private
network namespace where possible (see tests/network_namespace.py for why: the Mooncake
client listens on every interface, and what happens where it is not possible)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.local_cache import CACHE_DIR_ENV
from tests.network_namespace import enter_private_network


def pytest_configure(config: pytest.Config) -> None:
    # Here, before test modules are imported: no test socket or library thread exists yet,
    # so everything the tests start lives in the new namespace.
    enter_private_network()


def pytest_report_header(config: pytest.Config) -> str:
    return f"network: {enter_private_network().note}"


@pytest.fixture(autouse=True, scope="session")
def _private_local_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never write into the user's cache dir (weight digests, default L3 pages);
    servers started as child processes inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("local-cache")))
        yield
