"""The prefill side's sender: once a prompt's KV is computed, write it to the decode pool.

Each job waits (on a thread of the sender's pool) for the decode instance to
register its room, writes every page of the prompt in one batch, ends the room
(done with the first token, or failed) and reports to ``on_done``, which hands the
result back to the scheduler: only then are the request's pages released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hicache.disaggregation.pool_descriptor import (
    IncompatiblePoolError,
    PoolDescriptor,
    transfer_plan,
)
from hicache.disaggregation.rooms import Registration, RoomTable
from hicache.disaggregation.transfer_engine import KVTransferEngine, KVTransferError
from hicache.memory.allocator import PageIds

logger = logging.getLogger(__name__)

# on_done(rid, error): error None when every page landed.
SendDone = Callable[[str, "str | None"], None]


@dataclass(frozen=True)
class SendJob:
    rid: str
    room: int
    pages: PageIds  # the prompt's pages in this pool, in order
    first_token: int
    logprobs: dict[str, Any] | None = None  # the first token's and the prompt's, if asked


class KVSender:
    def __init__(
        self, engine: KVTransferEngine, pool: PoolDescriptor, rooms: RoomTable,
        timeout_s: float, on_done: SendDone, max_workers: int = 8,
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.rooms = rooms
        self.timeout_s = timeout_s
        self.on_done = on_done
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="hicache-kv-send")

    def send(self, job: SendJob) -> None:
        self._executor.submit(self._run, job)

    def _run(self, job: SendJob) -> None:
        error: str | None
        try:
            error = self._transfer(job)
        except Exception as unexpected:  # a bug here must still end the room and the request
            logger.exception("sending the KV of request %s failed", job.rid)
            error = f"internal error sending the KV: {type(unexpected).__name__}: {unexpected}"
        self.rooms.finish(job.room, job.first_token if error is None else None, error,
                          job.logprobs)
        if error is not None:
            logger.warning("request %s (room %d): %s", job.rid, job.room, error)
        self.on_done(job.rid, error)

    def _transfer(self, job: SendJob) -> str | None:
        waited = self.rooms.wait_registration(job.room, time.monotonic() + self.timeout_s)
        if not isinstance(waited, Registration):
            return waited.error or f"room {job.room} ended as {waited.state.value}"
        if len(waited.pages) != len(job.pages):
            return (f"the decode instance allocated {len(waited.pages)} pages for a prompt of "
                    f"{len(job.pages)} pages: do both instances use the same --page-size?")
        try:
            plan = transfer_plan(self.pool, job.pages, waited.pool, waited.pages)
            self.engine.write(waited.session_id, plan.sources, plan.destinations, plan.lengths)
        except (KVTransferError, IncompatiblePoolError, ValueError) as failure:
            return f"KV transfer to the decode instance failed: {failure}"
        return None

    def close(self) -> None:
        """Stop: jobs waiting for a registration end now; a transfer under way finishes."""
        self.rooms.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
