"""Clients that send a request and leave: the load of the "nothing computed for nobody" tests.

``held_request`` writes one HTTP/1.1 request on a socket of its own and reads
nothing: the server sees a client waiting for its answer until the test closes
the socket (``leave``), which is a disconnect at a moment the test chooses (once
the request is queued, say) rather than after a client-side timeout. ``scrape``
reads a /metrics page as ``{series with its labels: value}``, for counters
compared before and after, and ``sample`` finds one series in it by its labels.
``long_prompt`` gives distinct token-id prompts, so that no abandoned prompt can
be served from another's cached prefix.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# The tiny preset's vocabulary is 512 ids; 0 is left out (some tokenizers' padding).
_VOCAB = 511


def long_prompt(index: int, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids, different for every ``index`` from the first token on."""
    return [1 + (index * 131 + position * 3) % _VOCAB for position in range(num_tokens)]


def held_request(base_url: str, path: str, payload: dict[str, Any]) -> socket.socket:
    """POST ``payload`` as JSON to ``base_url + path``; the socket, answer unread."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(payload).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    sock = socket.create_connection((host, port), timeout=10.0)
    sock.sendall(head.encode() + body)
    return sock


def leave(sock: socket.socket) -> None:
    """The client goes away: its connection closes (FIN) at once."""
    with contextlib.suppress(OSError):  # the server closed it first
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of series ``name`` with exactly ``labels`` in ``samples`` (from ``scrape``),
    in whatever order the page writes the labels; 0.0 when the page has none."""
    wanted = sorted(labels.items())
    for key, value in samples.items():
        series, _, rest = key.partition("{")
        if series == name and sorted(_LABEL.findall(rest)) == wanted:
            return value
    return 0.0


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of ``base_url``'s /metrics, keyed as written (name{labels})."""
    response = httpx.get(f"{base_url}/metrics", timeout=30.0)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
