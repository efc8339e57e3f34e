"""DeadlineCaller: run a blocking call with a deadline, on a thread the caller can walk away from.

Python cannot stop a thread, so a call into a store that stops answering (a
hung NFS read, a stalled remote store) would hold its caller forever. A
``DeadlineCaller`` runs each call on a *runner* thread and waits for it at
most ``timeout_s``. A call still running then is *abandoned*: its runner is
left to finish it and then exits, and the next call gets a fresh runner, so
one hung call never delays the next.

The owner hears of both moments through callbacks made under one lock:
``on_abandon`` (on the waiting thread, when it gives up) always comes before
``on_late_return`` (on the runner, when the abandoned call finally returns).
How many abandoned calls may pile up is the owner's decision (it stops
calling); this class starts one thread per abandoned call.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.openmp import one_openmp_thread_here


@dataclass(eq=False)
class Call:
    """One call handed to a runner; ``value``/``error`` are valid once ``done``."""

    fn: Callable[[], Any]
    began_s: float  # time.monotonic() when it was handed over
    done: bool = False
    abandoned: bool = False
    value: Any = None
    error: Exception | None = None
    context: Any = None  # what ``on_abandon`` returned, handed back to ``on_late_return``

    @property
    def returned(self) -> bool:
        """Returned normally (no exception) within its deadline."""
        return self.done and not self.abandoned and self.error is None


class DeadlineCaller:
    """Calls ``fn()`` on a runner thread, waiting at most a deadline. See the module docstring."""

    def __init__(self, name: str, on_late_return: Callable[[Call], None]) -> None:
        self._name = name
        self._on_late_return = on_late_return
        self._cond = threading.Condition()
        self._inbox: queue.SimpleQueue[Call | None] | None = None
        self._runner_ids = itertools.count()

    def run(
        self, fn: Callable[[], Any], timeout_s: float, on_abandon: Callable[[Call], Any]
    ) -> Call:
        """Run ``fn`` and wait up to ``timeout_s``; the call, done or abandoned.

        Only one thread may use a DeadlineCaller (calls are not overlapped).
        """
        call = Call(fn, time.monotonic())
        with self._cond:
            inbox = self._inbox if self._inbox is not None else self._start_runner()
        inbox.put(call)
        with self._cond:
            self._cond.wait_for(lambda: call.done, timeout_s)
            if not call.done:
                call.abandoned = True
                self._inbox = None  # the runner keeps this call; the next one gets a fresh runner
                call.context = on_abandon(call)
        return call

    def close(self) -> None:
        """Let the idle runner exit (abandoned runners exit when their call returns)."""
        with self._cond:
            inbox, self._inbox = self._inbox, None
        if inbox is not None:
            inbox.put(None)

    def _start_runner(self) -> queue.SimpleQueue[Call | None]:
        inbox: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=self._serve, args=(inbox,), daemon=True,
            name=f"{self._name}-runner-{next(self._runner_ids)}",
        )
        thread.start()
        self._inbox = inbox
        return inbox

    def _serve(self, inbox: queue.SimpleQueue[Call | None]) -> None:
        one_openmp_thread_here()  # the backend's copies beside the forward (hicache.openmp)
        while True:
            call = inbox.get()
            if call is None:
                return
            value: Any = None
            error: Exception | None = None
            try:
                value = call.fn()
            except Exception as raised:  # handed to the waiting thread, which counts it
                error = raised
            finally:
                with self._cond:
                    call.value, call.error, call.done = value, error, True
                    self._cond.notify_all()
                    late = call.abandoned
                    if late:
                        self._on_late_return(call)
            if late:
                return  # this runner was replaced when its call was abandoned
