"""Import a declared dev dependency in a test module, failing (not skipping) where it is missing.

The test set-up (``scripts/bootstrap.sh``) installs every L3 backend's client and server;
a test run that lacks one has a broken install, and skipping would hide it. So a test
module that needs one starts with::

    redis = require_dev_dependency("redis", "pip install 'hicache[redis]'")

which returns the imported module, or fails the whole module with the hint. Set
``HICACHE_ALLOW_MISSING_DEV_DEPS=1`` to skip instead, on a machine where a backend's
package cannot be installed (say why in the run's notes); CI never sets it.

``require_program`` does the same for a server binary the tests start (``redis-server``).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import TypeVar

import pytest

ALLOW_MISSING_ENV = "HICACHE_ALLOW_MISSING_DEV_DEPS"
T = TypeVar("T")


def _missing(what: str, install_hint: str, error: object) -> None:
    message = f"dev dependency {what} is missing ({error}); install it: {install_hint}"
    if os.environ.get(ALLOW_MISSING_ENV) == "1":
        pytest.skip(message, allow_module_level=True)
    pytest.fail(message + f" (or set {ALLOW_MISSING_ENV}=1 to skip)", pytrace=False)


def require_dev_dependency(module: str, install_hint: str) -> ModuleType:
    """``module`` imported; a failed import fails the test module (see the module docstring)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        _missing(repr(module), install_hint, error)
        raise  # unreachable: _missing always raises


def require_program(program: str, install_hint: str) -> str:
    """The path of ``program`` on PATH; a missing one fails the test module."""
    path = shutil.which(program)
    if path is None:
        _missing(f"program {program!r}", install_hint, "not on PATH")
        raise AssertionError("unreachable")
    return path


def require_found(what: str, found: T | None, install_hint: str) -> T:
    """``found`` (a program or environment a helper looked up); None fails the test module."""
    if found is None:
        _missing(what, install_hint, "not found")
        raise AssertionError("unreachable")
    return found
