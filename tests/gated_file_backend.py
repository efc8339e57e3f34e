"""A file L3 whose reads (or writes) hang while a gate file exists: a hung NFS mount, on demand.

For tests that run ``hicache serve`` in a child process: the test creates the
gate file to make every ``get`` block (as a stalled store would, holding the
host pages it was given) and removes it to let them return; likewise ``write_gate``
(optional) for every ``set``. Loaded through the ``dynamic`` backend::

    {"module_path": "tests.gated_file_backend", "class_name": "GatedFileBackend",
     "path": "<l3 dir>", "gate": "<gate file>", "write_gate": "<another gate file>"}
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.memory.allocator import PageIds
from hicache.storage.backends.file.backend import FileBackend

POLL_S = 0.05


class GatedFileBackend(FileBackend):
    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        config = dict(extra_config or {})
        self.gate = Path(config.pop("gate"))
        write_gate = config.pop("write_gate", None)
        self.write_gate = Path(write_gate) if write_gate is not None else None
        super().__init__(config)

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        while self.gate.exists():  # the scenario: reads hang until the test opens the gate
            time.sleep(POLL_S)
        return super().get(keys, host_pages)

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        while self.write_gate is not None and self.write_gate.exists():  # writes hang
            time.sleep(POLL_S)
        return super().set(keys, host_pages)
