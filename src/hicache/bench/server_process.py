"""``hicache serve`` in a child process on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from hicache.net import free_port


class ServerStartError(RuntimeError):
    """The server exited, or did not become healthy in time (the message has its log's tail)."""


class ServerProcess:
    """``hicache serve`` in a child process on a free loopback port.

    ``with ServerProcess(args, log) as server:`` starts it and waits for
    /health; leaving the block always stops it (SIGTERM, then SIGKILL if it
    has not exited within ``stop_timeout_s``).
    """

    def __init__(
        self, args: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0, stop_timeout_s: float = 20.0,
        launcher: Sequence[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # ``launcher`` replaces the program (tests run a stand-in server); the flags stay.
        program = launcher or [sys.executable, "-m", "hicache", "--log-level", "info", "serve"]
        self.command = [*program, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = log_path
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"the server exited with status {code} before it was ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"the server was not ready after {self.startup_timeout_s:.0f} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> int | None:
        """Stop the server (idempotent); its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
