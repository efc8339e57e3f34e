"""The request -> page table: one device-resident row of page ids per running request.

Attention backends read each context's K/V in place through it (``ForwardBatch``).
It persists across steps and is written only where a request's pages change: all
of a row when a request is admitted (its cached prefix), one entry when a decode
crosses into a new page, the entries the radix tree replaced by its own copies
after a prefill. Writes are staged on the host and applied in one scatter before
the step's forward, so a step costs one small host-to-device copy, not one per
request, and never one per context token.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.memory.allocator import PageIds


class PageTableFullError(RuntimeError):
    """More running requests than the table has rows (a scheduler bug)."""


class ReqToPageTable:
    def __init__(self, num_rows: int, max_pages: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.max_pages = max_pages
        self.table = torch.zeros((num_rows, max_pages), dtype=torch.int32, device=device)
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out row 0 first
        # Staged writes: row, column and page id of each changed entry.
        self._rows: list[np.ndarray] = []
        self._cols: list[np.ndarray] = []
        self._pages: list[np.ndarray] = []

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise PageTableFullError(f"all {self.num_rows} page-table rows are in use")
        return self._free.pop()

    def release(self, row: int) -> None:
        """The row's entries stay as they are: nothing reads past a context's length, and
        the next owner writes every page it uses."""
        self._free.append(row)

    def write(self, row: int, start: int, pages: PageIds) -> None:
        """Stage ``table[row, start : start + len(pages)] = pages``."""
        count = len(pages)
        if count == 0:
            return
        if start + count > self.max_pages:
            raise PageTableFullError(
                f"a context of {start + count} pages does not fit the table's {self.max_pages}"
            )
        self._rows.append(np.full(count, row, dtype=np.int64))
        self._cols.append(np.arange(start, start + count, dtype=np.int64))
        self._pages.append(np.asarray(pages, dtype=np.int32))

    def replace(self, row: int, old: PageIds, new: PageIds) -> None:
        """Stage the entries where ``new`` (the row's pages now) differs from ``old``."""
        common = min(len(old), len(new))
        changed = np.flatnonzero(old[:common] != new[:common])
        if len(changed):
            self._rows.append(np.full(len(changed), row, dtype=np.int64))
            self._cols.append(changed.astype(np.int64))
            self._pages.append(new[changed].astype(np.int32))
        self.write(row, common, new[common:])

    def flush(self) -> None:
        """Apply every staged write (one scatter); before a forward reads the table."""
        if not self._rows:
            return
        device = self.table.device
        rows = torch.from_numpy(np.concatenate(self._rows))
        cols = torch.from_numpy(np.concatenate(self._cols))
        pages = torch.from_numpy(np.concatenate(self._pages))
        self._rows.clear()
        self._cols.clear()
        self._pages.clear()
        if device.type != "cpu":
            rows, cols, pages = (t.to(device, non_blocking=True) for t in (rows, cols, pages))
        self.table.index_put_((rows, cols), pages)
