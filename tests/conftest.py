"""Session-wide test setup: the whole run in a private network namespace where possible.

See tests/network_namespace.py for why (the Mooncake client listens on every
interface) and what happens where it is not possible.
"""

from __future__ import annotations

import pytest

from tests.network_namespace import enter_private_network


def pytest_configure(config: pytest.Config) -> None:
    # Here, before test modules are imported: no test socket or library thread exists yet,
    # so everything the tests start lives in the new namespace.
    enter_private_network()


def pytest_report_header(config: pytest.Config) -> str:
    return f"network: {enter_private_network().note}"
