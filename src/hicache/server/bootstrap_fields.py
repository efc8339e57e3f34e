"""SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` request fields.

A PD router adds them to the request it sends to a prefill and a decode instance
(both get the same body): they name the prefill instance's bootstrap server and the
room the two instances know the request by. A prefill or decode instance refuses a
request without them (it cannot run it alone); a plain instance ignores them.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hicache.engine.api import Bootstrap
from hicache.server.errors import APIError
from hicache.server.state import ServerState

MAX_ROOM = 2**63 - 1


def disaggregation_mode(state: ServerState) -> str:
    return str(state.info.server_args.get("disaggregation_mode") or "null")


def request_bootstrap(state: ServerState, host: Any, port: Any, room: Any) -> Bootstrap | None:
    """The request's Bootstrap on a prefill or decode instance (400 when missing or
    malformed); None on a plain instance."""
    mode = disaggregation_mode(state)
    if mode == "null":
        return None
    if host is None or port is None or room is None:
        raise APIError(
            400, f"this server is the {mode} side of a prefill-decode deployment: a request "
            "needs bootstrap_host, bootstrap_port and bootstrap_room (send it through a PD "
            "router, e.g. hicache router --pd-disaggregation)", param="bootstrap_room",
        )
    if not isinstance(host, str) or not host:
        raise APIError(400, "bootstrap_host must be a host name or address",
                       param="bootstrap_host")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise APIError(400, f"bootstrap_port must be a port number, got {port!r}",
                       param="bootstrap_port")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise APIError(400, f"bootstrap_room must be an integer in [0, 2**63 - 1], got {room!r}",
                       param="bootstrap_room")
    return Bootstrap(host, port, room)


def sample_room(room: int, index: int) -> int:
    """The bootstrap room of sample ``index`` of a request with ``n`` samples: each sample's
    KV moves on its own, so each needs a room, and the two instances (both given the
    request's one room) must derive the same ones. Sample 0 keeps the request's room; the
    others take a hash of (room, index), so that they collide with another request's
    rooms no more often than random rooms do, however a router picks its rooms."""
    if index == 0:
        return room
    digest = hashlib.blake2b(f"{room}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_ROOM
