"""An ASGI app served from a thread on one fixed loopback port, stopped and started
again at will: while stopped, its port refuses connections, as a server that died
or is restarting does.

``serve_app_in_thread`` (server_fixtures.py) picks a fresh port each time; a test of
what a client makes of a server that goes away and comes back needs the same address
both times.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from tests.waiting import wait_until

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class RestartableServer:
    def __init__(self, app: FastAPI) -> None:
        self.app = app
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        sock = socket.socket()
        # Connections of the last run may linger in TIME_WAIT: bind the port anyway.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="test-restartable", daemon=True)
        thread.start()
        self._server, self._thread, self._sock = server, thread, sock
        wait_until(lambda: server.started or not thread.is_alive(), START_TIMEOUT_S)
        if not server.started:
            raise RuntimeError("the test server did not start")

    def stop(self) -> None:
        """Stop serving and close the port: connections are refused from now on."""
        server, thread, sock = self._server, self._thread, self._sock
        self._server = self._thread = self._sock = None
        if server is None or thread is None or sock is None:
            return
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")

    def __enter__(self) -> RestartableServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
