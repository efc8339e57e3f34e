"""The prefill side's rooms: one per disaggregated request, keyed by its bootstrap room.

Both sides reach a room independently and in either order: the decode instance
registers where the KV goes (``register``), the prefill instance's sender waits for
that (``wait_registration``) once its prompt is computed, writes the KV and ends the
room (``finish``); the decode instance reads the end (``status``, a long poll). A
room read in its final state by the decode side is forgotten; rooms nobody reads
are dropped ``stale_after_s`` after they were made.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.memory.allocator import PageIds


class RoomState(str, Enum):
    WAITING = "waiting"  # made by the prefill side; the decode side has not registered
    REGISTERED = "registered"  # the decode side said where the KV goes
    SENDING = "sending"  # the transfer is under way
    DONE = "done"  # every page landed; first_token is set
    FAILED = "failed"  # error is set
    CANCELLED = "cancelled"  # the decode side gave up (error is set)

    @property
    def final(self) -> bool:
        return self in (RoomState.DONE, RoomState.FAILED, RoomState.CANCELLED)


@dataclass(frozen=True)
class Registration:
    """Where a request's KV goes: the decode engine's session, its pool and its pages."""

    session_id: str
    pool: PoolDescriptor
    pages: PageIds


@dataclass
class Room:
    state: RoomState = RoomState.WAITING
    registration: Registration | None = None
    first_token: int | None = None
    error: str | None = None
    # The first token's (and the prompt's) log probabilities, when the request asked for
    # them: JSON the engine encodes and decodes (``engine.logprobs.handoff_logprobs``).
    logprobs: dict[str, Any] | None = None
    made_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RoomStatus:
    state: RoomState
    first_token: int | None = None
    error: str | None = None
    logprobs: dict[str, Any] | None = None


class RoomTable:
    def __init__(self, stale_after_s: float) -> None:
        self._rooms: dict[int, Room] = {}
        self._changed = threading.Condition()
        self.stale_after_s = stale_after_s
        self._closed = False

    def close(self) -> None:
        """Shutting down: every wait ends now (rooms still waiting fail)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _room(self, room: int) -> Room:
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = Room()
        return entry

    def register(self, room: int, registration: Registration) -> None:
        with self._changed:
            self._drop_stale()
            entry = self._room(room)
            if entry.state.final:
                return  # the prefill side ended it already: the status read says how
            if entry.state is not RoomState.WAITING:
                raise ValueError(f"room {room} is already {entry.state.value}")
            entry.registration = registration
            entry.state = RoomState.REGISTERED
            self._changed.notify_all()

    def wait_registration(self, room: int, deadline: float) -> Registration | RoomStatus:
        """Block until the decode side registered ``room`` (then the room is SENDING and
        its registration returned), or it was cancelled or ``deadline`` (monotonic)
        passed: then the room is ended and its final status returned."""
        with self._changed:
            entry = self._room(room)
            while entry.state is RoomState.WAITING:
                left = deadline - time.monotonic()
                if self._closed:
                    entry.state, entry.error = RoomState.FAILED, "the prefill instance shut down"
                    break
                if left <= 0:
                    entry.state = RoomState.FAILED
                    entry.error = "no decode instance registered this request's bootstrap " \
                        "room in time"
                    break
                self._changed.wait(left)
            if entry.state is RoomState.REGISTERED:
                assert entry.registration is not None
                entry.state = RoomState.SENDING
                return entry.registration
            return RoomStatus(entry.state, entry.first_token, entry.error)

    def finish(
        self, room: int, first_token: int | None, error: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> None:
        """End a room: done with ``first_token`` (and its ``logprobs``, when asked for) or
        failed with ``error``."""
        with self._changed:
            entry = self._room(room)
            if entry.state.final:
                return
            entry.state = RoomState.FAILED if error is not None else RoomState.DONE
            entry.first_token, entry.error = first_token, error
            entry.logprobs = logprobs if error is None else None
            self._changed.notify_all()

    def cancel(self, room: int, reason: str) -> RoomState:
        """The decode side gave up; returns the state the room was in. A room whose KV is
        being sent stays SENDING: its pages are written to until the sender ends it, so
        the decode side waits for that end before it frees them."""
        with self._changed:
            entry = self._room(room)
            before = entry.state
            if before in (RoomState.WAITING, RoomState.REGISTERED):
                entry.state, entry.error = RoomState.CANCELLED, reason
            self._changed.notify_all()
            return before

    def status(self, room: int, wait_s: float) -> RoomStatus:
        """The room's state, waiting up to ``wait_s`` for it to end; a final state read
        here is the last read (the room is forgotten)."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            entry = self._room(room)
            while not entry.state.final:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._changed.wait(left)
            if entry.state.final:
                del self._rooms[room]
            return RoomStatus(entry.state, entry.first_token, entry.error, entry.logprobs)

    def _drop_stale(self) -> None:
        cutoff = time.monotonic() - self.stale_after_s
        for room in [r for r, entry in self._rooms.items() if entry.made_at < cutoff]:
            del self._rooms[room]

    def __len__(self) -> int:
        with self._changed:
            return len(self._rooms)
