"""A real HTTP server for tests: a tiny engine behind uvicorn on a free 127.0.0.1 port.

``serve_in_thread`` builds the engine (dummy weights of the tiny preset on CPU,
a 2048-token device pool of 16-token pages unless the caller's flags say
otherwise), serves ``create_app`` from a background thread, and on exit stops
uvicorn and shuts the engine down. Tests talk to it over loopback like any
client would, and reach the engine directly for integrity checks.
"""

from __future__ import annotations

import argparse
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.server.app import create_app
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from hicache.server.drain import DEFAULT_DRAIN_TIMEOUT_S
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from hicache.server.server_info import client_tokenizer_path, server_info_from_args
from hicache.server.warm import DEFAULT_WARM_HOST_FRACTION
from hicache.tenancy.identity import TenantIdentity
from tests.waiting import wait_until

# On CPU even where a GPU is present: the same numbers, hence the same greedy outputs,
# on every machine.
TINY_ENGINE_ARGS = ("--device", "cpu", "--max-total-tokens", "2048", "--page-size", "16")
# Guards against a hang, far above what a machine busy with other work needs; they cost
# nothing when the server starts, stops or settles in time.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
WAIT_S = 60.0


@dataclass
class RunningServer:
    url: str
    engine: Engine

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
        """Poll ``condition`` until it holds; False if it never did within ``timeout_s``."""
        return wait_until(condition, timeout_s)

    def wait_idle(self, timeout_s: float = WAIT_S) -> bool:
        return self.wait_until(self.engine.is_idle, timeout_s)


def parse_test_args(engine_args: Sequence[str] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args([*TINY_ENGINE_ARGS, *engine_args])


def build_test_engine(engine_args: Sequence[str] = ()) -> Engine:
    return build_engine(engine_config_from_args(parse_test_args(engine_args)))


@contextmanager
def serve_app_in_thread(app: FastAPI, *, lifespan: str = "off") -> Iterator[str]:
    """Serve ``app`` with uvicorn from a background thread; yields its base URL.
    ``lifespan="on"`` runs the app's start-up and shut-down (it started once yielded)."""
    # Bound here, handed to uvicorn: the port is known before the thread starts
    # and no other process can take it in between.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan=lifespan,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True
    )
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), START_TIMEOUT_S)
        if not server.started:
            raise RuntimeError("the test server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")


@contextmanager
def serve_in_thread(
    engine_args: Sequence[str] = (), *, admin_api_key: str | None = None,
    admin_allow_dynamic_backend: bool = False, served_model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, l3_path_root: str | None = None,
    strict_model_name: bool = False, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    on_drained: Callable[[], None] | None = None,
    warm_host_fraction: float = DEFAULT_WARM_HOST_FRACTION,
    identity: TenantIdentity | None = None,
) -> Iterator[RunningServer]:
    args = parse_test_args(engine_args)
    engine = build_engine(engine_config_from_args(args))
    try:
        app = create_app(
            engine, admin_api_key=admin_api_key,
            admin_allow_dynamic_backend=admin_allow_dynamic_backend,
            served_model_name=served_model_name,
            info=server_info_from_args(args, client_tokenizer_path(
                args.model_path, engine.tokenizer, args.dtype, args.device)),
            max_request_bytes=max_request_bytes, l3_path_root=l3_path_root,
            strict_model_name=strict_model_name, drain_timeout_s=drain_timeout_s,
            on_drained=on_drained, warm_host_fraction=warm_host_fraction, identity=identity,
        )
        with serve_app_in_thread(app) as url:
            yield RunningServer(url, engine)
    finally:
        engine.shutdown()


@contextmanager
def long_stream(server: RunningServer) -> Iterator[None]:
    """Inside: a streaming /generate request that runs far longer than any test, already
    producing tokens (the engine is busy). Leaving closes the connection mid-stream."""
    payload = {
        "text": "a long answer, please", "stream": True,
        "sampling_params": {"max_new_tokens": server.engine.max_context_len - 64,
                            "ignore_eos": True},
    }
    with httpx.Client(timeout=30.0) as client, client.stream(
        "POST", f"{server.url}/generate", json=payload
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"long stream refused: {response.status_code}")
        # Held until the end: dropping a half-read line iterator closes the connection.
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        if not first.startswith("data: {"):
            raise RuntimeError(f"long stream: unexpected first event {first!r}")
        yield
