"""The decode side's receiver: tell the prefill instance where the KV goes, wait for it.

Each job (on a thread of the receiver's pool) registers the request's room with the
prefill instance's bootstrap server, then long-polls the room until it ends: done
(the first token) or failed. It gives up when ``timeout_s`` passed since it began,
or when the prefill instance stops answering for ``UNREACHABLE_GRACE_S`` (it died).
Pages are freed by the scheduler only after ``on_done``: a room being written to
is waited for (one timeout more), so that no late write lands in freed pages.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hicache.disaggregation.bootstrap_client import (
    BootstrapClient,
    BootstrapRefusedError,
    BootstrapUnreachableError,
)
from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.disaggregation.rooms import Registration, RoomState, RoomStatus
from hicache.memory.allocator import PageIds

logger = logging.getLogger(__name__)

# A prefill instance that does not answer for this long is taken for dead.
UNREACHABLE_GRACE_S = 2.0
POLL_WAIT_S = 0.5
RETRY_S = 0.1

# on_done(rid, first_token, logprobs, error): exactly one of first_token and error is
# None; logprobs (the prefill instance's JSON) only with a first token, when asked for.
ReceiveDone = Callable[[str, "int | None", "dict[str, Any] | None", "str | None"], None]


@dataclass(frozen=True)
class ReceiveJob:
    rid: str
    host: str
    port: int
    room: int
    pages: PageIds  # allocated in this pool for the prompt, in order


class KVReceiver:
    def __init__(
        self, session_id: str, pool: PoolDescriptor, timeout_s: float, on_done: ReceiveDone,
        max_workers: int = 32,
    ) -> None:
        self.session_id = session_id
        self.pool = pool
        self.timeout_s = timeout_s
        self.on_done = on_done
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="hicache-kv-recv")
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def receive(self, job: ReceiveJob) -> None:
        self._executor.submit(self._run, job)

    def give_up(self, host: str, port: int, room: int) -> None:
        """Tell the prefill instance (on a thread of the pool) that a room it may be
        computing will never be registered: its request there fails now, not at its
        timeout. Best effort: a prefill instance that does not answer times out."""
        def cancel() -> None:
            with contextlib.suppress(BootstrapUnreachableError, BootstrapRefusedError):
                BootstrapClient(host, port).cancel(room)

        self._executor.submit(cancel)

    def cancel(self, rid: str) -> None:
        """The request was aborted: give its room up (its job still reports on_done)."""
        with self._lock:
            self._cancelled.add(rid)

    def _is_cancelled(self, rid: str) -> bool:
        with self._lock:
            return rid in self._cancelled

    def _run(self, job: ReceiveJob) -> None:
        status: RoomStatus | None = None
        try:
            status, error = self._wait_for_kv(job)
        except Exception as unexpected:  # a bug here must still end the request
            logger.exception("receiving the KV of request %s failed", job.rid)
            error = f"internal error receiving the KV: {unexpected}"
        with self._lock:
            self._cancelled.discard(job.rid)
        if error is not None:
            logger.warning("request %s (room %d): %s", job.rid, job.room, error)
            self.on_done(job.rid, None, None, error)
        else:
            assert status is not None
            self.on_done(job.rid, status.first_token, status.logprobs, None)

    def _wait_for_kv(self, job: ReceiveJob) -> tuple[RoomStatus | None, str | None]:
        """The room's final status once its KV landed, or why it did not."""
        client = BootstrapClient(job.host, job.port)
        deadline = time.monotonic() + self.timeout_s
        where = f"the prefill instance at {job.host}:{job.port}"
        registration = Registration(self.session_id, self.pool, job.pages)
        unreachable_since: float | None = None
        registered = cancel_sent = False
        timed_out = False
        while True:
            now = time.monotonic()
            if self._closing.is_set():
                with contextlib.suppress(BootstrapUnreachableError, BootstrapRefusedError):
                    client.cancel(job.room)
                return None, "the decode instance shut down"
            if now >= deadline:
                if timed_out or not self._still_sending(client, job.room):
                    return None, (f"KV transfer timed out: {where} did not send this "
                                  f"request's KV within {self.timeout_s:g} s")
                # Its pages are being written to: freed now, they could be overwritten
                # under their next owner. Wait (once more) for the sender to end.
                timed_out = True
                deadline = now + self.timeout_s
            try:
                if not registered:
                    client.register(job.room, registration)
                    registered = True
                if self._is_cancelled(job.rid) and not cancel_sent:
                    client.cancel(job.room)
                    cancel_sent = True
                status = client.status(job.room, min(POLL_WAIT_S, max(deadline - now, 0.0)))
            except BootstrapUnreachableError as error:
                if unreachable_since is None:
                    unreachable_since = now
                if now - unreachable_since >= UNREACHABLE_GRACE_S:
                    return None, f"KV transfer failed: {where} is unreachable ({error})"
                time.sleep(RETRY_S)
                continue
            except BootstrapRefusedError as error:
                return None, f"KV transfer failed: {where} refused the handshake ({error})"
            unreachable_since = None
            if status.state is RoomState.DONE:
                return status, None
            if status.state.final:
                return None, f"KV transfer failed on {where}: {status.error}"

    @staticmethod
    def _still_sending(client: BootstrapClient, room: int) -> bool:
        """Give ``room`` up; True when the prefill side was sending it then."""
        try:
            return client.cancel(room) is RoomState.SENDING
        except (BootstrapUnreachableError, BootstrapRefusedError):
            return False  # nobody there writes any more

    def close(self) -> None:
        """Stop: every job gives its room up and ends within one poll."""
        self._closing.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
