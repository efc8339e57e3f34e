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
# Characters that JSON leaves raw in a string (it escapes only those below U+0020) but that
# line readers with str.splitlines' rules (httpx's iter_lines among them) take for line
# ends: a generated text holding one would cut its event in two there. They are escaped;
# outside strings JSON has none, so the event means the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(payload: Any) -> str:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text.translate(_LINE_BREAKS)}\n\n"


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
