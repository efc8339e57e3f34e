"""Busy cores during a benchmark run (``hicache bench compare --background-load N``).

A serving engine on a shared machine competes with other work for its cores. To
measure how each side holds up, not just on an idle machine, N processes spin on
pure Python for the length of every run (hicache's and the baseline's alike), so
the comparison sees the same competition on both sides. They run at the servers'
own priority: a niced spinner would only take idle time and prove nothing.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """``count`` spinning processes while the block runs (none for 0); always stopped."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=10)
