"""Whether the HTTP client of a request is still there, learnt the moment it leaves.

A route waits on the engine twice before it answers: for a queued request's
first output (``start_generation``: the engine validates a request when its
stream is first read) and, not streamed, for the whole answer. Either wait can
be long (a queue behind long generations), and a client may give up during it.
``until_client_leaves`` races the wait against the client's disconnect and, when
the client goes first, cancels the wait, which closes the engine's stream: the
engine drops the request before its next step, from the waiting queue if it was
still queued, so an abandoned prompt costs no prefill.

The disconnect is read from the ASGI ``receive`` channel, which, once the body
was read, has nothing more to deliver than ``http.disconnect``: waiting on it is
event-driven, with no polling delay in which a queued request could be admitted.
Invariants: a watch is only waited on after the route read the body, and every
wait ends with the call that started it (nothing listens after the handler
returned, so a streaming response's own disconnect listener is the only one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from hicache.server.errors import APIError

T = TypeVar("T")

# An ASGI server that answers ``receive`` at once with something else than a
# disconnect (nothing should, once the body is read) is asked again this much later:
# never a busy loop.
RECEIVE_RETRY_S = 0.05
CLIENT_GONE_STATUS = 499  # nginx's "client closed request"; nobody reads the answer


class ClientWatch:
    """The disconnect of one HTTP request's client (``request.receive``)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.left = False

    async def wait(self) -> None:
        """Return when the client has closed the connection."""
        while not self.left:
            message = await self._receive()
            if message.get("type") == "http.disconnect":
                self.left = True
            else:
                await asyncio.sleep(RECEIVE_RETRY_S)


class ClientGone(APIError):
    """The client left before its answer was ready; the request was dropped."""

    def __init__(self) -> None:
        super().__init__(CLIENT_GONE_STATUS, "the client closed the connection")


async def until_client_leaves(work: Awaitable[T], watch: ClientWatch | None) -> T:
    """``await work``, unless ``watch``'s client leaves first: then ``work`` is
    cancelled (and awaited) and ``ClientGone`` raised. An answer ready when the client
    leaves is still returned; without a watch this is ``await work``."""
    if watch is None:
        return await work
    task = asyncio.ensure_future(work)
    if watch.left:
        task.cancel()
    gone = asyncio.ensure_future(watch.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not task.cancelled():
            return task.result()
        raise ClientGone
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
