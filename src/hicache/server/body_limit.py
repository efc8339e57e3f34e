"""The request body size limit (``--max-request-bytes``), enforced while the body arrives.

An ASGI middleware in front of every route of the server and of the router. A
request that declares a ``Content-Length`` over the limit is answered 413 at
once: the app never runs and not one byte of the body is buffered (uvicorn
discards what the client still sends, so the connection stays usable). A body
without a length (chunked) is counted as it arrives: the read that carries it
over the limit raises ``BodyTooLargeError``, a 413 through the app's error
handlers, so at most the limit plus one chunk is ever held.

Invariant: no route sees more than ``max_bytes`` of body. The default is
generous for any real request (a whole 128K-token context as JSON token ids is
about 1 MB, a chat with tool definitions a few) yet bounds what the event loop
and the JSON parser can be made to chew on: parsing is off the loop
(``body``), but C-level parsers hold the interpreter lock while they run.
"""

from __future__ import annotations

import argparse

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.server.errors import APIError, error_response

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
FLAG = "--max-request-bytes"


class BodyTooLargeError(APIError):
    """A request body over the limit (a 413)."""

    def __init__(self, max_bytes: int, declared: int | None = None) -> None:
        size = f"is {declared} bytes" if declared is not None else "is larger"
        super().__init__(
            413, f"the request body {size}; this server accepts at most {max_bytes} bytes "
            f"({FLAG})",
        )


class BodyLimitMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"{FLAG} must be > 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # Answered before the app runs and before anything is read: a client that
            # waits for "100 Continue" never even sends the body.
            refusal = BodyTooLargeError(self.max_bytes, declared)
            await error_response(refusal.status, refusal.message)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses such a request before the app
    return None


def max_request_bytes(text: str) -> int:
    """argparse type of ``--max-request-bytes``: a positive number of bytes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_max_request_bytes_arg(group: argparse._ArgumentGroup, default: int) -> None:
    group.add_argument(
        FLAG, type=max_request_bytes, default=default, metavar="BYTES",
        help="largest request body accepted; a larger one is answered 413 before it is read "
        "(default: %(default)s, 16 MiB)",
    )
