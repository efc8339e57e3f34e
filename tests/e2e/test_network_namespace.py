"""The test session runs in a private network namespace when it can (root on Linux):
loopback is the only interface, it works, and the processes tests start share it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.network_namespace import (
    OPT_OUT_ENV,
    interface_names,
    isolate_network,
    session_isolation,
)


@pytest.fixture()
def private() -> None:
    isolation = session_isolation()
    assert isolation is not None, "tests/conftest.py did not set the session's network up"
    if not isolation.private:
        pytest.skip(f"the session runs on {isolation.note}")


@pytest.mark.usefixtures("private")
def test_only_loopback_exists_and_it_works() -> None:
    assert interface_names() == ["lo"]
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(
        server.getsockname(), timeout=5
    ):
        accepted, _ = server.accept()
        accepted.close()


@pytest.mark.usefixtures("private")
def test_the_namespace_is_not_the_one_pytest_was_started_in() -> None:
    ours = os.readlink("/proc/self/ns/net")
    assert ours != os.readlink(f"/proc/{os.getppid()}/ns/net")
    try:
        init = os.readlink("/proc/1/ns/net")
    except OSError:  # some sandboxes hide pid 1's namespaces
        return
    assert ours != init


@pytest.mark.usefixtures("private")
def test_child_processes_share_the_private_namespace(tmp_path: Path) -> None:
    probe = "import os, socket; print(os.readlink('/proc/self/ns/net'), " \
        "[n for _, n in socket.if_nameindex()])"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60,
        cwd=tmp_path,
    ).stdout.split(" ", 1)
    assert out[0] == os.readlink("/proc/self/ns/net")
    assert out[1].strip() == "['lo']"


@pytest.mark.parametrize(("env", "uid", "words"), [
    ({OPT_OUT_ENV: "1"}, 0, f"{OPT_OUT_ENV} is set"),
    ({}, 1000, "not root"),
])
def test_where_it_cannot_the_session_stays_on_the_network_and_says_why(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], uid: int, words: str
) -> None:
    monkeypatch.delenv(OPT_OUT_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    before = os.readlink("/proc/self/ns/net")
    isolation = isolate_network()
    assert not isolation.private
    assert words in isolation.note and "Mooncake" in isolation.note
    assert os.readlink("/proc/self/ns/net") == before  # nothing was entered
