"""``hicache serve``: help, the embedded defaults, the tier switches the benchmarks use, the
startup log, and a real server process started, used and stopped."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from hicache.cli import build_parser
from hicache.cli import main as cli_main
from hicache.engine.build import build_engine
from hicache.model.presets import get_preset
from hicache.net import free_port
from hicache.server.args import storage_config_from_args
from hicache.server.engine_args import engine_config_from_args
from hicache.server.serve import log_tiers
from hicache.server.serve import main as serve_main
from hicache.testing.server_process import ServerProcess
from tests.listeners import listening_sockets
from tests.waiting import wait_until

# Dummy weights of the tiny preset: serve's own default model (SmolLM2) is tested elsewhere.
POOL = ["--device", "cpu", "--max-total-tokens", "1024"]
SMALL = [*POOL, "--model-preset", "tiny"]
START_TIMEOUT_S = 90.0  # a cold interpreter imports torch first


def test_serve_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--port", "--host", "--served-model-name", "--admin-api-key",
                 "--admin-allow-dynamic-backend", "--disable-hierarchical-cache",
                 "--hicache-storage-backend", "none"):
        assert flag in out


def test_defaults_turn_every_tier_on() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.page_size) == ("127.0.0.1", 30000, 16)
    assert args.enable_hierarchical_cache is True
    assert args.hicache_storage_backend == "file"
    assert storage_config_from_args(args).backend == "file"
    assert args.log_level is None  # main picks info for serve
    # --log-level works before the subcommand and after it.
    assert build_parser().parse_args(["--log-level", "debug", "serve"]).log_level == "debug"
    assert build_parser().parse_args(["serve", "--log-level", "error"]).log_level == "error"


@pytest.mark.parametrize(
    ("flags", "l2", "l3", "prefix_cache"),
    [
        ([], True, "file", True),
        (["--hicache-storage-backend", "none"], True, None, True),
        (["--disable-hierarchical-cache", "--hicache-storage-backend", "none"], False, None,
         True),
        (["--disable-radix-cache", "--disable-hierarchical-cache",
          "--hicache-storage-backend", "none"], False, None, False),
    ],
)
def test_benchmark_tier_configurations(
    flags: list[str], l2: bool, l3: str | None, prefix_cache: bool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path))
    args = build_parser().parse_args(["serve", *SMALL, *flags])
    engine = build_engine(engine_config_from_args(args))
    try:
        assert engine.cache.hierarchical is l2
        storage = engine.cache.storage
        assert (storage.backend.name if storage is not None else None) == l3
        assert engine.scheduler.limits.enable_prefix_cache is prefix_cache
        if l3 == "file":
            assert storage is not None
            assert getattr(storage.backend, "root", None) == tmp_path / "l3"
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--disable-radix-cache"], "--disable-hierarchical-cache --hicache-storage-backend none"),
        (["--disable-hierarchical-cache"], "--hicache-storage-backend none"),
        (["--hicache-storage-backend-extra-config", "{nope"], "not valid JSON"),
        (["--tp-size", "2", "--single-process"], "drop --single-process"),
    ],
)
def test_inconsistent_flags_fail_with_the_fix(
    flags: list[str], words: str, caplog: pytest.LogCaptureFixture
) -> None:
    args = build_parser().parse_args(["serve", *SMALL, *flags])
    with caplog.at_level(logging.ERROR):
        assert serve_main(args) == 2
    assert words in caplog.text


@pytest.mark.parametrize(("flags", "allowed"), [([], False),
                                               (["--admin-allow-dynamic-backend"], True)])
def test_serve_hands_the_dynamic_backend_permission_to_the_app(
    flags: list[str], allowed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[bool] = []

    def run(server: uvicorn.Server) -> None:  # instead of serving: look at the app
        app = server.config.app
        assert isinstance(app, FastAPI)
        served.append(app.state.hicache.admin_allow_dynamic_backend)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    args = build_parser().parse_args(
        ["serve", *SMALL, "--hicache-storage-backend", "none", *flags]
    )
    assert serve_main(args) == 0
    assert served == [allowed]


def test_startup_log_names_each_tier_and_is_loud_without_l3(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = build_parser().parse_args(["serve", *SMALL, "--hicache-storage-backend", "none"])
    engine = build_engine(engine_config_from_args(args))
    try:
        with caplog.at_level(logging.INFO, logger="hicache.serve"):
            log_tiers(engine)
        lines = [r.getMessage() for r in caplog.records if r.name == "hicache.serve"]
        assert [line.split(":")[0] for line in lines] == [
            "L1 device KV pool", "L2 host KV pool", "L3 storage"
        ]
        assert lines[2] == "L3 storage: off"
        caplog.clear()
        # Configured but unreachable at start: the cache records why; the log shouts it.
        engine.cache.storage_error = "store at 10.0.0.1:50051 refused the connection"
        with caplog.at_level(logging.INFO, logger="hicache.serve"):
            log_tiers(engine)
        errors = [r for r in caplog.records
                  if r.name == "hicache.serve" and r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "NOT ATTACHED" in errors[0].getMessage()
        assert "refused the connection" in errors[0].getMessage()
    finally:
        engine.shutdown()


def test_serve_subprocess_answers_then_stops(tmp_path: Path) -> None:
    server = ServerProcess(
        SMALL, tmp_path / "serve.log",
        env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
        startup_timeout_s=START_TIMEOUT_S,
    )
    server.start()
    process, url, log_path = server.process, server.url, server.log_path
    assert process is not None
    try:
        health = httpx.get(f"{url}/health", timeout=10.0)
        assert health.json()["l3"] == {"attached": True, "backend": "file"}
        # The server is reachable from this machine only.
        assert listening_sockets(process.pid) == [("127.0.0.1", server.port)]
        response = httpx.post(
            f"{url}/v1/completions", timeout=30.0,
            json={"model": "dummy-tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGTERM)  # the server alone, as its own shutdown
        try:
            code = process.wait(timeout=30)
        finally:
            server.kill()
    log = log_path.read_text()
    # SIGTERM drains (nothing in flight; L3 has what was written through), then exits 0.
    assert code == 0, log
    assert "drain done" in log
    assert "engine stopped" in log
    assert "L1 device KV pool" in log and "L2 host KV pool" in log
    assert f"L3 storage: file at {tmp_path / 'cache' / 'l3'}" in log


def test_serve_names_the_model_after_model_path_as_given(tmp_path: Path) -> None:
    """As SGLang: /v1/models and /get_model_info name the model by --model-path, exactly
    as given; requests may name it so or by its last path component."""
    model_dir = tmp_path / "weights" / "Tiny-Dummy"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    given = f"{model_dir}/"  # a trailing slash stays in the name
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "hicache", "serve", "--port", str(port), *POOL,
             "--model-path", given, "--load-format", "dummy",
             "--hicache-storage-backend", "none"],
            stdout=log_file, stderr=subprocess.STDOUT,
            env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
        )
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert process.poll() is None, f"serve exited early:\n{log_path.read_text()}"
            try:
                return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, START_TIMEOUT_S, poll_s=0.2), (
            f"serve did not come up:\n{log_path.read_text()}"
        )
        models = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"]
        assert [m["id"] for m in models] == [given]
        info = httpx.get(f"{url}/model_info", timeout=10.0).json()
        assert info["model_path"] == given
        # The dir has no tokenizer.json: clients get the byte-level tokenizer's dir.
        assert Path(info["tokenizer_path"], "tokenizer.json").is_file()
        server = httpx.get(f"{url}/server_info", timeout=10.0).json()
        assert server["model_path"] == given and server["page_size"] == 16
        assert server["hicache_storage_backend"] is None
        for name in (given, "Tiny-Dummy"):
            response = httpx.post(f"{url}/v1/completions", timeout=30.0, json={
                "model": name, "prompt": "hello", "max_tokens": 2, "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == given
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
            raise


def _engine_processes(pid: int) -> list[int]:
    """The engine processes ``pid`` spawned (multiprocessing also starts a resource tracker)."""
    return [child for child in _children(pid)
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The fields after the command name (which may hold spaces) start at its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _start_serve(tmp_path: Path, *flags: str) -> ServerProcess:
    """A started ``hicache serve`` (no L3) logging to tmp_path/serve.log; ``kill`` ends it
    with every process of its group."""
    server = ServerProcess(
        [*SMALL, "--hicache-storage-backend", "none", *flags], tmp_path / "serve.log",
        env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
        startup_timeout_s=START_TIMEOUT_S,
    )
    server.start()
    return server


def test_serve_exits_nonzero_when_its_engine_process_dies(tmp_path: Path) -> None:
    server = _start_serve(tmp_path)
    process, log_path = server.process, server.log_path
    assert process is not None
    try:
        engines = _engine_processes(process.pid)
        assert len(engines) == 1, engines  # the engine runs in a process of its own
        os.kill(engines[0], signal.SIGKILL)
        code = process.wait(timeout=20)  # within seconds, never a hang
    finally:
        server.kill()
    log = log_path.read_text()
    assert code == 1, log
    assert "the engine process died" in log


def test_serve_tp2_exits_nonzero_when_rank_one_dies(tmp_path: Path) -> None:
    server = _start_serve(tmp_path, "--tp-size", "2")
    process, url, log_path = server.process, server.url, server.log_path
    assert process is not None
    try:
        info = httpx.get(f"{url}/get_server_info", timeout=10.0).json()
        assert info["tp_size"] == 2
        reply = httpx.post(f"{url}/generate", timeout=60.0, json={
            "input_ids": list(range(3, 30)),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        })
        assert reply.status_code == 200, reply.text
        assert len(_engine_processes(process.pid)) == 2  # one process per rank
        found = re.search(r"tensor-parallel rank 1 of 2 ready \(pid (\d+)\)",
                          log_path.read_text())
        assert found is not None, log_path.read_text()
        os.kill(int(found.group(1)), signal.SIGKILL)
        code = process.wait(timeout=20)  # within seconds, never a hang
    finally:
        server.kill()
    log = log_path.read_text()
    assert code == 1, log
    assert "tensor-parallel rank 1 exited" in log


def test_serve_tp2_fails_to_start_at_once_with_rank_ones_reason(tmp_path: Path) -> None:
    """Rank 1's L3 store fails to attach (rank 0's works): serve exits 2 with rank 1's
    reason, as soon as the ranks agree the start failed (not at a collective timeout)."""
    extra = json.dumps({"module_path": "tests.tp_start_faults",
                        "class_name": "RankOneFailsAttach"})
    server = ServerProcess(
        [*SMALL, "--tp-size", "2", "--hicache-storage-backend", "dynamic",
         "--hicache-storage-backend-extra-config", extra], tmp_path / "serve.log",
        env={**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")},
    )
    server.launch()  # not awaited: it is to exit at start-up
    assert server.process is not None
    try:
        # Interpreters importing torch, then fast.
        code = server.process.wait(timeout=START_TIMEOUT_S)
    finally:
        server.kill()
    log = server.log_text()
    assert code == 2, log
    assert ("cannot start the engine: tensor-parallel rank 1 could not start: StorageError: "
            "injected: rank 1 cannot attach its L3 store") in log
    assert "engine processes ready" not in log


def test_the_engine_process_never_outlives_its_server(tmp_path: Path) -> None:
    server = _start_serve(tmp_path)
    process = server.process
    assert process is not None
    try:
        engines = _engine_processes(process.pid)
        assert len(engines) == 1, engines
        process.kill()  # no shutdown at all: the engine sees its pipe close
        process.wait(timeout=10)
        assert wait_until(
            lambda: not Path(f"/proc/{engines[0]}").exists() or _is_zombie(engines[0]),
            20, poll_s=0.1,
        ), "the engine process outlived its server"
    finally:
        server.kill()


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_single_process_serves_without_an_engine_process(tmp_path: Path) -> None:
    server = _start_serve(tmp_path, "--single-process")
    process, url = server.process, server.url
    assert process is not None
    try:
        assert _engine_processes(process.pid) == []
        response = httpx.post(f"{url}/generate", timeout=30.0, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == 3
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            server.kill()
