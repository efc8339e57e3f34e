"""The launcher (hicache.testing.launcher): readiness by a logged line, a failed start
reported with the log's tail, and stop ending the program's whole process group.

The programs are tiny Python scripts, so these run without any server installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hicache.testing.launcher import ChildProcess, LaunchError

# A program that spawns a grandchild (its pid on the first line), says it is ready, waits.
_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "print('ready now', flush=True)\n"
    "time.sleep(60)\n"
)


class Script(ChildProcess):
    """A Python script, ready once it has logged ``marker``."""

    ready_timeout_s = 60.0  # a guard: the scripts start in well under a second

    def __init__(self, script: str, log_path: Path, marker: str = "ready now") -> None:
        super().__init__(log_path, stop_timeout_s=5.0)
        self.script = script
        self.marker = marker

    @property
    def name(self) -> str:
        return "script"

    def command_line(self) -> list[str]:
        return [sys.executable, "-c", self.script]

    def ready(self) -> bool:
        return self.logged(self.marker)

    def awaited(self) -> str:
        return f"log {self.marker!r}"


def _alive(pid: int) -> bool:
    """Running (a zombie, whose parent has not read its status yet, has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ready_by_a_logged_line_and_stop_ends_the_whole_group(tmp_path: Path) -> None:
    with Script(_PARENT, tmp_path / "script.log") as script:
        assert script.running and script.group_alive
        grandchild = int(script.log_text().splitlines()[0])
        assert _alive(grandchild)
    assert not script.running and not script.group_alive
    assert not _alive(grandchild)
    assert script.stop() == script.kill()  # idempotent, the same exit status


def test_an_exit_before_ready_is_reported_with_the_log(tmp_path: Path) -> None:
    script = Script("print('no luck today'); raise SystemExit(3)", tmp_path / "script.log")
    with pytest.raises(LaunchError, match=r"(?s)script exited with status 3.*no luck today"):
        script.start()
    assert not script.running


def test_not_ready_in_time_is_stopped_and_reported(tmp_path: Path) -> None:
    script = Script("import time; print('starting', flush=True); time.sleep(60)",
                    tmp_path / "script.log")
    with pytest.raises(LaunchError, match=r"(?s)did not log 'ready now' within 0.5 s.*starting"):
        script.start(ready_timeout=0.5)
    assert not script.running and not script.group_alive


def test_each_launch_starts_the_log_afresh_unless_appending(tmp_path: Path) -> None:
    log = tmp_path / "script.log"
    log.write_text("an earlier run\n")
    with Script("print('ready now', flush=True); import time; time.sleep(60)", log):
        pass
    assert "an earlier run" not in log.read_text()
