"""Attached file stores over one test directory, closed together (the file backend's tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.storage.backends.file.backend import FileBackend


class FileOpener:
    """Opens file backends on ``root`` with ``defaults`` (each call's options override
    them), each attached to a fresh host pool from ``make_host``; ``close`` closes all."""

    def __init__(
        self, root: Path, make_host: Callable[[MemLayout], HostPool], **defaults: Any
    ) -> None:
        self.root = root
        self.make_host = make_host
        self.defaults = defaults
        self.opened: list[FileBackend] = []

    def __call__(
        self, layout: MemLayout = MemLayout.PAGE_FIRST, **options: Any
    ) -> tuple[FileBackend, HostPool]:
        backend = FileBackend({"path": str(self.root), **self.defaults, **options})
        host = self.make_host(layout)
        backend.attach(host)
        self.opened.append(backend)
        return backend, host

    def close(self) -> None:
        for backend in self.opened:
            backend.close()


def host_maker(
    geometry: KVGeometry, page_size: int, num_pages: int
) -> Callable[[MemLayout], HostPool]:
    """Fresh unpinned host pools of ``num_pages`` pages, in the layout asked for."""
    def make(layout: MemLayout) -> HostPool:
        return HostPool(geometry, num_pages, page_size, layout, pin_memory=False)
    return make


def opened(
    root: Path, make_host: Callable[[MemLayout], HostPool], **defaults: Any
) -> Iterator[FileOpener]:
    """A fixture's body: a ``FileOpener``, its stores closed after the test."""
    opener = FileOpener(root, make_host, **defaults)
    try:
        yield opener
    finally:
        opener.close()
