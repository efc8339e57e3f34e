"""Server-sent events: ``data: <json>`` frames, ``data: [DONE]`` at the end.

``EventStreamResponse`` closes its event generator once the response is over,
however it ended. Starlette stops iterating when the client disconnects but
does not close the generator; closing it here runs the generator's
``finally`` at once, which closes the engine's stream and so aborts the
request and frees its KV pages, instead of leaving that to garbage collection.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events, media_type="text/event-stream",
            # Proxies must pass each event on as it comes.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
