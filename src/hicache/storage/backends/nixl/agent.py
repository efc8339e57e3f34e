"""One NIXL agent driving one storage plugin: batches between registered host memory and files.

NIXL (NVIDIA's Inference Xfer Library) moves bytes between two descriptor
lists through a plugin: here DRAM descriptors (``(address, bytes, 0)``, inside
memory registered with the agent) against FILE descriptors (``(file offset,
bytes, fd)``, whose fds are registered too). One ``initialize_xfer`` + post is
one transfer request for a whole batch of pages; the POSIX plugin submits all
its descriptors to one kernel queue (Linux AIO, io_uring or POSIX AIO) and we
poll the request until it is done or its deadline passes.

The Python package comes in one wheel per CUDA major version (``nixl_cu12``,
``nixl_cu13``); the ``nixl`` meta package picks the one that matches the
CUDA stack, and falls back to what is installed on a machine without CUDA. We
import through ``nixl`` when it is installed and straight from ``nixl_cu12``
otherwise (what the ``hicache[nixl]`` extra installs).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from hicache.storage.base import StorageError
from hicache.storage.failure_reasons import FailureReason


def _import_nixl() -> tuple[ModuleType, ModuleType]:
    """NIXL's ``_api`` and ``_bindings`` modules (ImportError naming what to install)."""
    try:
        importlib.import_module("nixl")
        package = "nixl"
    except ModuleNotFoundError as error:
        if error.name != "nixl":
            raise
        package = "nixl_cu12"  # ModuleNotFoundError("nixl_cu12") when neither is there
    return (
        importlib.import_module(f"{package}._api"),
        importlib.import_module(f"{package}._bindings"),
    )


_api, _bindings = _import_nixl()
# NIXL's exceptions share no base class but Exception; these are all of them.
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(_bindings, name) for name in dir(_bindings)
    if name.startswith("nixl") and name.endswith("Error")
)

_AGENT_START_ERRORS: tuple[type[Exception], ...] = (RuntimeError, *NIXL_ERRORS)

_PLUGIN_NEEDS = {
    "GDS": "CUDA and NVIDIA GPUDirect Storage (libcufile), i.e. a GPU machine",
    "GDS_MT": "CUDA and NVIDIA GPUDirect Storage (libcufile), i.e. a GPU machine",
}
_POLL_SPIN = 64  # polls before the first sleep: most batches finish within microseconds
_POLL_SLEEP_MAX_S = 0.001
_agent_numbers = itertools.count()


class TransferFailed(Exception):
    """A batch did not complete: ``reason`` is the failure name counted in stats."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class NixlAgent:
    """A local NIXL agent with one file plugin; every method is thread-safe (STRICT sync)."""

    def __init__(self, plugin: str, init_params: dict[str, str]) -> None:
        self.plugin = plugin
        self.name = f"hicache-{os.getpid()}-{next(_agent_numbers)}"
        config = _api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[],
            sync_mode=_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent: Any = _api.nixl_agent(self.name, config)
        except _AGENT_START_ERRORS as error:  # no plugin could be found at all
            raise StorageError(f"nixl storage: cannot start a NIXL agent: {error}") from error
        available = list(self._agent.get_plugin_list())
        if plugin not in available:
            raise StorageError(
                f"nixl storage: NIXL has no {plugin!r} plugin here (it has "
                f"{', '.join(available)}); check the NIXL install or NIXL_PLUGIN_DIR"
            )
        try:
            self._agent.create_backend(plugin, init_params)
        except NIXL_ERRORS as error:
            needs = _PLUGIN_NEEDS.get(plugin)
            why = f"; it needs {needs}" if needs else ""
            raise StorageError(
                f"nixl storage: the NIXL {plugin} plugin cannot be loaded on this machine "
                f"({type(error).__name__}){why}. Use plugin 'POSIX' here"
            ) from error
        self._registered: list[Any] = []

    def register_dram(self, address: int, nbytes: int) -> None:
        """Register host memory once; transfers may then use any range inside it."""
        try:
            handle = self._agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        except NIXL_ERRORS as error:
            raise StorageError(
                f"nixl storage: registering {nbytes} bytes of host memory failed: {error}"
            ) from error
        self._registered.append(handle)

    def close(self) -> None:
        """Deregister the host memory; the agent itself goes with the last reference."""
        while self._registered:
            handle = self._registered.pop()
            with contextlib.suppress(*NIXL_ERRORS):  # the agent is going away with it
                self._agent.deregister_memory(handle)

    def transfer(
        self, op: str, memory: np.ndarray, files: np.ndarray, fds: Sequence[int], file_bytes: int,
        timeout_s: float,
    ) -> None:
        """Move one batch: ``op`` "READ" (files -> memory) or "WRITE" (memory -> files).

        ``memory`` and ``files`` are Nx3 uint64 descriptor arrays of equal lengths
        (``(address, bytes, 0)`` and ``(offset, bytes, fd)``); ``fds`` are the
        distinct files, registered for this request only. Raises ``TransferFailed``
        when NIXL refuses the request, reports an error or misses the deadline
        (then the request is cancelled; if NIXL cannot cancel it, this keeps
        waiting, since the kernel may still write into the host pages).
        """
        registered = self._register_files(fds, file_bytes)
        try:
            local = self._agent.get_xfer_descs(memory, "DRAM")
            remote = self._agent.get_xfer_descs(files, "FILE")
            handle = self._agent.initialize_xfer(op, local, remote, self.name)
        except NIXL_ERRORS as error:
            self._deregister(registered)
            raise TransferFailed(
                FailureReason.IO_ERROR, f"NIXL refused the {op}: {error}") from error
        try:
            self._wait(handle, op, time.monotonic() + timeout_s)
        finally:
            self._release(handle)
            self._deregister(registered)

    def _wait(self, handle: Any, op: str, deadline: float) -> None:
        try:
            state = self._agent.transfer(handle)
            polls = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferFailed(FailureReason.TIMEOUT, f"the {op} missed its deadline")
                polls += 1
                if polls > _POLL_SPIN:
                    time.sleep(min(_POLL_SLEEP_MAX_S, 1e-5 * (polls - _POLL_SPIN)))
                state = self._agent.check_xfer_state(handle)
        except NIXL_ERRORS as error:  # the plugin's error (a short read, EIO, ENOSPC ...)
            raise TransferFailed(FailureReason.IO_ERROR, f"NIXL {op} failed: {error}") from error
        if state != "DONE":
            raise TransferFailed(FailureReason.IO_ERROR, f"NIXL {op} ended in state {state}")

    def _release(self, handle: Any) -> None:
        """Free a request; one still in flight is cancelled, or waited for if it cannot be."""
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except NIXL_ERRORS:
                # Not cancellable right now: the I/O may still land in host pages, so the
                # call must not return before it has (the controller's own deadline
                # keeps those pages reserved while we wait).
                time.sleep(_POLL_SLEEP_MAX_S)
                with contextlib.suppress(*NIXL_ERRORS):
                    self._agent.check_xfer_state(handle)

    def _register_files(self, fds: Sequence[int], file_bytes: int) -> Any:
        try:
            return self._agent.register_memory(
                [(0, file_bytes, fd, "") for fd in fds], "FILE"
            )
        except NIXL_ERRORS as error:
            raise TransferFailed(
                FailureReason.IO_ERROR, f"NIXL cannot register the files: {error}") from error

    def _deregister(self, registered: Any) -> None:
        with contextlib.suppress(*NIXL_ERRORS):  # the fds are closed next: nothing holds them
            self._agent.deregister_memory(registered)
