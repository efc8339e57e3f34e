"""Where transfers run: a CUDA stream on GPU, a worker thread on CPU.

Both give the same contract: ``submit(work)`` runs ``work`` (which issues
copies through an io backend) after everything submitted before it, and
returns a Completion. Completions of one executor finish in submission order.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from hicache.openmp import one_openmp_thread_here

Work = Callable[[], None]


class Completion(ABC):
    @abstractmethod
    def query(self) -> bool:
        """True once the work's copies have landed (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the copies have landed; re-raise a failure."""

    def wait_on_stream(self) -> None:
        """Order later compute after the copies; on CPU this blocks like wait()."""
        self.wait()


class Executor(ABC):
    @abstractmethod
    def submit(self, work: Work) -> Completion: ...

    @abstractmethod
    def close(self) -> None:
        """Finish submitted work and release resources; submit() fails afterwards."""


class _EventCompletion(Completion):
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()

    def wait_on_stream(self) -> None:
        torch.cuda.current_stream(self._event.device).wait_event(self._event)


class CudaStreamExecutor(Executor):
    """Issues work on a dedicated stream; the calling thread never blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._closed = False

    def submit(self, work: Work) -> Completion:
        if self._closed:
            raise RuntimeError("executor is closed")
        # Pages handed to a transfer may have just been freed by compute still in
        # flight on the compute stream: order the copy after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work()
            event = torch.cuda.Event()
            event.record(self.stream)
        return _EventCompletion(event)

    def close(self) -> None:
        if not self._closed:
            self.stream.synchronize()
            self._closed = True


class _ThreadCompletion(Completion):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("transfer failed") from self._error


class ThreadExecutor(Executor):
    """Runs work in order on one worker thread (torch CPU copies release the GIL)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Work, _ThreadCompletion] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, work: Work) -> Completion:
        if self._closed:
            raise RuntimeError("executor is closed")
        completion = _ThreadCompletion()
        self._queue.put((work, completion))
        return completion

    def _run(self) -> None:
        one_openmp_thread_here()
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, completion = item
            try:
                work()
            except BaseException as error:  # handed to whoever waits on the completion
                completion.finish(error)
            else:
                completion.finish(None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()


def create_executor(device: torch.device, name: str) -> Executor:
    if device.type == "cuda":
        return CudaStreamExecutor(device)
    return ThreadExecutor(name)
