"""How the router recognises a draining worker, from its /health and its answers.

The workers' drain contract: a draining worker answers ``GET /health`` with 503 and
``{"status": "draining"}``, and refuses new generation requests with a 503 whose error
message says it is draining, with ``Retry-After: 0``. Its running requests finish.

A 503 alone means nothing of the kind (an overloaded or failing worker answers it too,
and that one counts towards the failure streak of ``health.py``): only the draining
body, or ``Retry-After: 0`` on a 503, says "not me, retry elsewhere now". Such an
answer is read whole before anything reaches the client (an error body is small, and
at most ``MAX_REFUSAL_BYTES`` are held), so the router can still send the request to
another worker. ``headers`` are ``httpx.Headers`` (or a mapping with lower-case names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import httpx

DRAINING: Final = "draining"
# A draining refusal is a short JSON error; a 503 body longer than this is passed on.
MAX_REFUSAL_BYTES: Final = 64 * 1024


def is_draining_health(response: httpx.Response) -> bool:
    """Is this /health answer a draining worker's (503, ``{"status": "draining"}``)?"""
    if response.status_code != 503:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == DRAINING


def says_retry_now(status: int, headers: Mapping[str, str]) -> bool:
    """A 503 with ``Retry-After: 0``: the worker asks for the request to go elsewhere
    at once (the body need not be read)."""
    return status == 503 and headers.get("retry-after", "").strip() == "0"


def is_draining_refusal(status: int, headers: Mapping[str, str], body: bytes) -> bool:
    """Is this whole answer to a proxied request a draining worker's refusal?"""
    if status != 503:
        return False
    if says_retry_now(status, headers):
        return True
    if headers.get("content-encoding", "identity") != "identity":
        return False  # a compressed error body is not a worker's refusal
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return any(DRAINING in text.lower() for text in _messages(parsed))


def _messages(body: Any) -> list[str]:
    """The texts an error body says what happened in: OpenAI's ``error.message``, and
    the plain ``message``/``detail``/``status`` of simpler bodies."""
    if not isinstance(body, dict):
        return []
    found = [body[key] for key in ("message", "detail", "status") if isinstance(body.get(key), str)]
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        found.append(error["message"])
    elif isinstance(error, str):
        found.append(error)
    return found
