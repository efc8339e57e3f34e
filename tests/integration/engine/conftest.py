"""Engine fixtures for the engine tests."""

from tests.engine_helpers import make_engine_fixture

__all__ = ["make_engine_fixture"]
