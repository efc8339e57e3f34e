"""What the nixl backend's tests share: the import that fails (not skips) when NIXL is missing."""

from __future__ import annotations

from tests.dev_dependency import require_dev_dependency

INSTALL_HINT = "bash scripts/bootstrap.sh (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"


def require_nixl() -> None:
    """Fail the calling test module where NIXL's Python package cannot be imported."""
    require_dev_dependency("nixl", INSTALL_HINT)
