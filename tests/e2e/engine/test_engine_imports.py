"""The engine package stands without the server's: importing it in a fresh interpreter loads
no ``hicache.server`` module."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_package_imports_nothing_of_the_server() -> None:
    # A fresh interpreter: this one has the server loaded by other tests.
    code = (
        "import sys, hicache.engine, hicache.engine.build, hicache.engine.engine\n"
        "import hicache.engine.config\n"
        "print(sorted(m for m in sys.modules if m.startswith('hicache.server')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
