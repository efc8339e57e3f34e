"""The prefill instance's bootstrap server: HTTP on ``--disaggregation-bootstrap-port``.

- ``PUT /rooms/{room}`` (decode -> prefill): ``{"session_id", "pool", "pages"}``, where
  the request's KV goes (``rooms.Registration``);
- ``GET /rooms/{room}?wait_s=S``: the room's state, waiting up to S seconds for it to
  end: ``{"state", "first_token", "error"}``;
- ``DELETE /rooms/{room}``: the decode side gives up on the room;
- ``GET /health``.

It runs on threads of its own (one per connection), never the scheduler's.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.disaggregation.rooms import Registration, RoomTable

logger = logging.getLogger(__name__)

_ROOM_PATH = re.compile(r"^/rooms/(\d+)$")
# A long poll never holds a connection longer than this.
MAX_WAIT_S = 5.0


class BootstrapServer:
    def __init__(self, rooms: RoomTable, host: str, port: int) -> None:
        self.rooms = rooms
        handler = type("Handler", (_Handler,), {"rooms": rooms})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hicache-pd-bootstrap", daemon=True
        )

    def start(self) -> BootstrapServer:
        self._thread.start()
        logger.info("disaggregation bootstrap server on port %d", self.port)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Handler(BaseHTTPRequestHandler):
    rooms: RoomTable
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("bootstrap: " + format, *args)

    def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _room(self) -> int | None:
        match = _ROOM_PATH.match(urlsplit(self.path).path)
        if match is None:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
            return None
        return int(match.group(1))

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/health":
            self._reply(HTTPStatus.OK, {"rooms": len(self.rooms)})
            return
        room = self._room()
        if room is None:
            return
        query = parse_qs(urlsplit(self.path).query)
        try:
            wait_s = min(float(query.get("wait_s", ["0"])[0]), MAX_WAIT_S)
        except ValueError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "wait_s must be a number"})
            return
        status = self.rooms.status(room, wait_s)
        self._reply(HTTPStatus.OK, {
            "state": status.state.value, "first_token": status.first_token,
            "error": status.error, "logprobs": status.logprobs,
        })

    def do_PUT(self) -> None:
        room = self._room()
        if room is None:
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length))
            registration = Registration(
                session_id=str(body["session_id"]), pool=PoolDescriptor.from_json(body["pool"]),
                pages=np.asarray(body["pages"], dtype=np.int64),
            )
            self.rooms.register(room, registration)
        except (ValueError, KeyError, TypeError) as error:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"bad registration: {error}"})
            return
        self._reply(HTTPStatus.OK, {"state": "registered"})

    def do_DELETE(self) -> None:
        room = self._room()
        if room is None:
            return
        before = self.rooms.cancel(room, "the decode instance gave up on this request")
        self._reply(HTTPStatus.OK, {"state_before": before.value})
