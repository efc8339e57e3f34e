"""The decode side of the handshake: HTTP calls to a prefill instance's bootstrap server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hicache.disaggregation.rooms import Registration, RoomState, RoomStatus

# Seconds a connection to the bootstrap server may take before it counts as unreachable.
CONNECT_TIMEOUT_S = 2.0


class BootstrapUnreachableError(ConnectionError):
    """The prefill instance's bootstrap server did not answer."""


class BootstrapRefusedError(RuntimeError):
    """The bootstrap server answered with an error (a bad or duplicate registration)."""


class BootstrapClient:
    def __init__(self, host: str, port: int) -> None:
        self.base_url = f"http://{host}:{port}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as error:
            raise BootstrapRefusedError(
                f"{self.base_url}{path}: {error.code} {error.read().decode(errors='replace')}"
            ) from error
        except (OSError, ValueError) as error:  # refused, reset, timed out, half an answer
            raise BootstrapUnreachableError(
                f"the prefill instance's bootstrap server at {self.base_url} did not answer: "
                f"{error}"
            ) from error

    def register(self, room: int, registration: Registration) -> None:
        self._call("PUT", f"/rooms/{room}", {
            "session_id": registration.session_id, "pool": registration.pool.to_json(),
            "pages": [int(p) for p in registration.pages],
        })

    def status(self, room: int, wait_s: float) -> RoomStatus:
        answer = self._call("GET", f"/rooms/{room}?wait_s={wait_s}",
                            timeout_s=wait_s + CONNECT_TIMEOUT_S)
        logprobs = answer.get("logprobs")
        return RoomStatus(RoomState(answer["state"]), answer.get("first_token"),
                          answer.get("error"), logprobs if isinstance(logprobs, dict) else None)

    def cancel(self, room: int) -> RoomState:
        """Give the room up; returns the state it was in (SENDING: it is still written to)."""
        return RoomState(self._call("DELETE", f"/rooms/{room}")["state_before"])
