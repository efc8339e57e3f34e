"""Outputs handed to the event loops once per scheduler step, not once per request.

Every ``loop.call_soon_threadsafe`` wakes the event loop's thread through its
self-pipe and takes the loop's lock: per request per step, that is the scheduler
thread's largest cost in a big decode batch. Outputs of one step are collected
here, per event loop, and each loop gets one callback that delivers its batch.
Used from the scheduler thread only (``emit`` and ``flush``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from hicache.engine.api import GenerateOutput

_Pending = list[tuple["asyncio.Queue[GenerateOutput]", GenerateOutput]]


class OutputBatcher:
    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, _Pending] = {}

    def emitter(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[GenerateOutput]
    ) -> Callable[[GenerateOutput], None]:
        """What a request's outputs are emitted through (on the scheduler thread)."""

        def emit(output: GenerateOutput) -> None:
            pending = self._pending.get(loop)
            if pending is None:
                pending = self._pending[loop] = []
            pending.append((queue, output))

        return emit

    def flush(self) -> None:
        """Hand each event loop the outputs collected for it since the last flush."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            # The caller's event loop may be gone already (asyncio.run returned right after
            # it abandoned the stream): nobody is left to read, so its outputs are dropped.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: _Pending) -> None:
    for queue, output in items:
        queue.put_nowait(output)
