"""Session-wide test settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.local_cache import CACHE_DIR_ENV


@pytest.fixture(autouse=True, scope="session")
def _private_local_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never write into the user's cache dir (weight digests, default L3 pages);
    servers started as child processes inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("local-cache")))
        yield
