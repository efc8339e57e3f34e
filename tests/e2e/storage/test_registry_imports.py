"""The storage package imports no backend by itself: each is imported by name when asked
(hicache.storage.registry), so a server on the file L3 never loads Mooncake's or NIXL's client."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_imports_no_backend() -> None:
    # A fresh interpreter: what `import hicache.storage` pulls in by itself.
    code = (
        "import sys, hicache.storage\n"
        "loaded = [m for m in sys.modules if m.startswith('hicache.storage.backends')\n"
        "          or m in ('mooncake', 'nixl', 'redis')]\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
