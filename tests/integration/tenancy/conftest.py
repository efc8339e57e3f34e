"""Engine fixtures for the tenancy tests."""

from tests.engine_helpers import make_engine_fixture

__all__ = ["make_engine_fixture"]
