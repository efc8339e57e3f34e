"""An external OpenAI-compatible server as the baseline of ``hicache bench compare``.

The user gives the command that starts it as one shell line with placeholders,
e.g. ``python -m vllm.entrypoints.openai.api_server --model {model} --host {host}
--port {port}``: ``{port}`` (required) becomes a free loopback port, ``{host}``
127.0.0.1 and ``{model}`` the baseline's model (``--baseline-model``, else the
``--model-path`` given to hicache). Other braces are left as they are, so JSON
arguments need no escaping. The line runs under ``/bin/sh -c`` in a process
group of its own; the server is ready when ``/health`` or ``/v1/models``
answers 200, and leaving the run stops the whole group (the shell, the server
and any engine processes it spawned).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from hicache.net import free_port
from hicache.testing.cpu_limit import CpuLimit
from hicache.testing.server_process import ChildServer

HOST = "127.0.0.1"
READY_PATHS = ("/health", "/v1/models")
_PLACEHOLDER = re.compile(r"\{(host|port|model)\}")


class BaselineError(ValueError):
    """The baseline command cannot be used as given."""


def check_template(template: str, model: str | None) -> None:
    """Fail early (before any server starts) on a command that cannot be filled in."""
    if not template.strip():
        raise BaselineError("--baseline-command is empty")
    names = set(_PLACEHOLDER.findall(template))
    if "port" not in names:
        raise BaselineError(
            "--baseline-command must contain {port}: the baseline is started on a free port "
            "the benchmark picks"
        )
    if "model" in names and not model:
        raise BaselineError(
            "--baseline-command uses {model}, but no model is known: give --baseline-model, "
            "or --model-path in --server-args"
        )


def render_command(template: str, *, port: int, model: str | None, host: str = HOST) -> str:
    """The shell line with ``{host}``, ``{port}`` and ``{model}`` filled in."""
    check_template(template, model)
    values = {"host": host, "port": str(port), "model": model or ""}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def model_path_of(server_args: Sequence[str]) -> str | None:
    """The ``--model-path`` among hicache's server flags, if any."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-path", default=None)
    known, _ = parser.parse_known_args(list(server_args))
    value: str | None = known.model_path
    return value


class BaselineServer(ChildServer):
    """The baseline's command on a free loopback port (see the module's documentation)."""

    def __init__(
        self, template: str, log_path: Path, *, name: str, model: str | None,
        env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 20.0, cpu_limit: CpuLimit | None = None,
    ) -> None:
        port = free_port()
        self.shell_command = render_command(template, port=port, model=model)
        super().__init__(
            ["/bin/sh", "-c", self.shell_command], port, log_path, env=env,
            startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s,
            ready_paths=READY_PATHS, name=f"the baseline server {name!r}", cpu_limit=cpu_limit,
        )

    def __enter__(self) -> BaselineServer:
        self.start()
        return self
