"""A file L3 whose attach and close hang while gate files exist: a store that stops
answering just when a server starts or stops, on demand.

For tests that run ``hicache serve`` in a child process and kill it: while
``attach_gate`` exists, ``attach`` blocks (after creating ``<attach_gate>.<pid>``,
so that the test knows which process is inside it); while ``close_gate`` exists,
``close`` blocks. Removing a gate lets the calls return. Loaded through the
``dynamic`` backend::

    {"module_path": "tests.stalling_l3", "class_name": "StallingFileBackend",
     "path": "<l3 dir>", "attach_gate": "<file>", "close_gate": "<file>"}
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.backend import FileBackend

POLL_S = 0.05


class StallingFileBackend(FileBackend):
    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        config = dict(extra_config or {})
        attach_gate, close_gate = config.pop("attach_gate", None), config.pop("close_gate", None)
        self.attach_gate = None if attach_gate is None else Path(attach_gate)
        self.close_gate = None if close_gate is None else Path(close_gate)
        super().__init__(config)

    def attach(self, host: HostPool) -> None:
        if self.attach_gate is not None:
            Path(f"{self.attach_gate}.{os.getpid()}").touch()
            _wait_while(self.attach_gate)
        super().attach(host)

    def close(self) -> None:
        if self.close_gate is not None:
            _wait_while(self.close_gate)
        super().close()


def _wait_while(gate: Path) -> None:
    # The stall itself, inside a server's rank: it hangs, with no deadline, until the
    # test removes the gate.
    while gate.exists():
        time.sleep(POLL_S)
