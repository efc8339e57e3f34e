"""A prefill and a decode ``hicache serve`` in child processes, and requests sent to them
the way a PD router sends them: the same body, with SGLang's bootstrap fields added, to
both at once; the decode instance's answer is the client's.

The children inherit the test session's private network namespace (loopback only),
where their Mooncake transfer engines listen.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hicache.net import free_port
from hicache.testing.server_process import ServerProcess

ADMIN_KEY = "pd-test-admin"
TIMEOUT_S = 60.0
_rooms = itertools.count(random.randrange(2**40))


@dataclass
class PDPair:
    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int

    def send(self, path: str, body: dict[str, Any], room: int | None = None,
             to_prefill: bool = True, to_decode: bool = True) -> tuple[httpx.Response | None,
                                                                        httpx.Response | None]:
        """POST ``body`` with bootstrap fields to both (or one) at once; (prefill's answer,
        decode's answer)."""
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                  "bootstrap_room": next(_rooms) if room is None else room}
        full = {**body, **fields}
        with ThreadPoolExecutor(2) as pool:
            prefill: Future[httpx.Response] | None = pool.submit(
                httpx.post, self.prefill.url + path, json=full, timeout=TIMEOUT_S
            ) if to_prefill else None
            decode: Future[httpx.Response] | None = pool.submit(
                httpx.post, self.decode.url + path, json=full, timeout=TIMEOUT_S
            ) if to_decode else None
            return (prefill.result() if prefill else None, decode.result() if decode else None)

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """The decode instance's /generate answer; both instances must answer 200."""
        prefill, decode = self.send("/generate", body)
        assert prefill is not None and prefill.status_code == 200, prefill and prefill.text
        assert decode is not None and decode.status_code == 200, decode.text
        answer: dict[str, Any] = decode.json()
        return answer


def check_integrity(server: ServerProcess) -> None:
    """The server's tree and pools are consistent and nothing leaked (it must be idle)."""
    response = httpx.post(f"{server.url}/hicache/check-integrity", timeout=TIMEOUT_S,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text


@contextmanager
def pd_pair(
    args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
    prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
) -> Iterator[PDPair]:
    """A prefill and a decode instance serving with ``args`` (and their own extras)."""
    bootstrap_port = free_port()
    common = [*args, "--admin-api-key", ADMIN_KEY]
    with ExitStack() as stack:
        prefill = ServerProcess(
            [*common, "--disaggregation-mode", "prefill",
             "--disaggregation-bootstrap-port", str(bootstrap_port), *prefill_args],
            log_dir / "prefill.log", env=env, startup_timeout_s=startup_timeout_s,
        )
        decode = ServerProcess(
            [*common, "--disaggregation-mode", "decode", *decode_args],
            log_dir / "decode.log", env=env, startup_timeout_s=startup_timeout_s,
        )
        for server in (prefill, decode):  # side by side: each imports torch cold
            stack.callback(server.stop)
            server.launch()
        prefill.wait_ready()
        decode.wait_ready()
        yield PDPair(prefill, decode, bootstrap_port)


def plain_server(args: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 120.0) -> ServerProcess:
    return ServerProcess([*args, "--admin-api-key", ADMIN_KEY], log_path, env=env,
                         startup_timeout_s=startup_timeout_s)
