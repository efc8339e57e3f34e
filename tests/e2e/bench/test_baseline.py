"""The external baseline of ``hicache bench compare``: its command, its process group, --cpus.

The baseline is the stand-in LLM server of ``tests/bench_fake_server.py``, started through
``--baseline-command`` like vLLM would be; the end-to-end test runs it next to a
real ``hicache serve`` of the tiny dummy model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from hicache.bench import compare
from hicache.bench.baseline import (
    BaselineError,
    BaselineServer,
    check_template,
    model_path_of,
    render_command,
)
from hicache.bench.compare import resolve_sizes, run_baseline
from hicache.cli import build_parser
from hicache.testing.cpu_limit import THREAD_VARIABLES, CpuLimit, CpuLimitError, available_cpus
from hicache.testing.server_process import ServerProcess, ServerStartError
from tests.waiting import wait_until

FAKE = Path(__file__).resolve().parents[2] / "bench_fake_server.py"
# What a user would type for vLLM, with the stand-in server in its place.
FAKE_COMMAND = (
    f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --host {{host}} --port {{port}} "
    "--model {model}"
)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def compare_args(*argv: str) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(["bench", "compare", *argv])
    resolve_sizes(args)
    return args


# ------------------------------------------------------------------------ the command line
def test_placeholders_are_filled_and_other_braces_kept() -> None:
    line = render_command(
        "serve --model {model} --host {host} --port {port} --cfg '{\"a\": {\"b\": 1}}'",
        port=4321, model="/models/m",
    )
    assert line == (
        "serve --model /models/m --host 127.0.0.1 --port 4321 --cfg '{\"a\": {\"b\": 1}}'"
    )


def test_bad_templates_are_refused() -> None:
    with pytest.raises(BaselineError, match=r"\{port\}"):
        check_template("serve --port 8000", None)
    with pytest.raises(BaselineError, match="--baseline-model"):
        check_template("serve --model {model} --port {port}", None)
    with pytest.raises(BaselineError, match="empty"):
        check_template("  ", None)
    check_template("serve --port {port}", None)  # no {model}: no model needed


def test_model_defaults_to_hicaches_model_path() -> None:
    assert model_path_of(["--device", "cpu", "--model-path", "/m/qwen", "--x", "1"]) == "/m/qwen"
    assert model_path_of(["--model-preset", "tiny"]) is None


def test_repeats_follow_the_baseline(tmp_path: Path) -> None:
    plain = compare_args("--out-dir", str(tmp_path))
    assert plain.api == "generate" and plain.repeats == 1
    with_baseline = compare_args("--out-dir", str(tmp_path), "--baseline-command", "x {port}")
    assert with_baseline.api == "generate" and with_baseline.repeats == 2
    assert with_baseline.baseline_api == "openai" and with_baseline.baseline_token_ids
    explicit = compare_args(
        "--out-dir", str(tmp_path), "--baseline-command", "x {port}", "--repeats", "3",
        "--no-baseline-token-ids",
    )
    assert explicit.repeats == 3 and not explicit.baseline_token_ids


@pytest.mark.parametrize(
    "flags",
    [
        ["--baseline-command", "serve --port 8000"],  # no {port}
        ["--baseline-command", "serve --model {model} --port {port}"],  # no model known
        ["--baseline-command", "serve --port {port}", "--baseline-name", "l1"],  # name clash
        ["--baseline-command", "serve --port {port}", "--repeats", "0"],
        ["--cpus", "100000"],
        ["--cpus", "0"],
    ],
)
def test_bad_baseline_flags_fail_before_any_server(tmp_path: Path, flags: list[str]) -> None:
    args = compare_args("--out-dir", str(tmp_path), "--smoke", *flags)
    assert compare.main(args) == 2
    assert not list(tmp_path.glob("*.server.log"))


# ------------------------------------------------------------------------ the process
def test_baseline_server_serves_and_its_whole_group_is_stopped(tmp_path: Path) -> None:
    # The shell leaves a child behind it (as an engine process would be): it must go too.
    template = f"sleep 300 & exec {FAKE_COMMAND}"
    server = BaselineServer(
        template, tmp_path / "b.log", name="fake", model="/m/x", stop_timeout_s=5
    )
    assert f"--port {server.port} --model /m/x" in server.shell_command
    with server:
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=5) as resp:
            assert json.load(resp)["data"][0]["id"] == "fake-model"
        assert server.process is not None
        group = server.process.pid
        assert group_alive(group)
    assert not listening(server.port)
    assert wait_until(lambda: not group_alive(group), 5, poll_s=0.05), (
        "a process of the baseline's group outlived the run"
    )
    assert '["--model", "/m/x"]' in server.log_text()


def test_baseline_that_exits_at_once_says_why(tmp_path: Path) -> None:
    server = BaselineServer(
        "echo 'vllm: no such model' >&2; exit 3 # {port}", tmp_path / "b.log", name="vllm",
        model=None,
    )
    with pytest.raises(ServerStartError) as caught, server:
        pass
    message = str(caught.value)
    assert "baseline server 'vllm' exited with status 3" in message
    assert "vllm: no such model" in message and str(tmp_path / "b.log") in message


def test_baseline_that_never_gets_ready_is_killed_with_its_children(tmp_path: Path) -> None:
    server = BaselineServer(
        "sleep 300 & sleep 300 # {port}", tmp_path / "b.log", name="slow", model=None,
        startup_timeout_s=0.5, stop_timeout_s=2,
    )
    with pytest.raises(ServerStartError, match=r"did not answer /health or /v1/models"), server:
        pass
    assert server.process is not None and server.process.poll() is not None
    assert not group_alive(server.process.pid)


def test_run_baseline_records_a_failure_and_leaves_nothing(tmp_path: Path) -> None:
    args = compare_args(
        "--out-dir", str(tmp_path), "--smoke", "--no-progress",
        "--baseline-command", "echo 'bad flag --frobnicate' >&2; exit 2 # {port}",
        "--baseline-name", "vllm",
    )
    run = run_baseline(args, tmp_path, {}, model=None, stem="vllm.1", repeat=1)
    assert run.baseline and run.summary is None and run.error is not None
    assert "status 2" in run.error and "bad flag --frobnicate" in run.error
    assert run.load_before is not None and run.load_after is not None
    assert (tmp_path / "vllm.1.server.log").is_file()


def test_run_baseline_drives_it_through_the_openai_api(tmp_path: Path) -> None:
    args = compare_args(
        "--out-dir", str(tmp_path), "--smoke", "--no-progress", "--num-clients", "2",
        "--num-rounds", "2", "--request-length", "40",
        "--baseline-command", FAKE_COMMAND,
    )
    run = run_baseline(args, tmp_path, {"k": 1}, model="/m/x", stem="baseline")
    assert run.error is None and run.summary is not None, run.error
    assert run.summary.overall.requests == 4 and run.summary.overall.failed == 0
    assert run.summary.config["api"] == "openai"
    assert "--port" in run.summary.config["baseline_command"]
    # Streamed with usage, so prompt and output counts are the server's.
    assert [r.output_tokens for r in run.records] == [4] * 4
    assert run.records[0].prompt_tokens == 40 and run.records[0].ttft_from_content
    assert (tmp_path / "baseline.json").is_file()


# ------------------------------------------------------------------------ --cpus
def test_cpu_limit_pins_the_server_and_sets_thread_counts(tmp_path: Path) -> None:
    limit = CpuLimit.first(1)
    assert limit.cpus == (available_cpus()[0],)
    env = limit.env({"PATH": "/bin"})
    assert all(env[v] == "1" for v in THREAD_VARIABLES) and env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(limit.cpus[0])
    server = ServerProcess(
        [], tmp_path / "s.log", launcher=[sys.executable, str(FAKE)], cpu_limit=limit
    )
    assert server.command[:3] == ["taskset", "-c", str(limit.cpus[0])]
    with server:
        pass
    log = server.log_text()
    assert f"fake server cpus: [{limit.cpus[0]}] OMP_NUM_THREADS: 1" in log


def test_cpu_limit_refuses_more_cpus_than_there_are() -> None:
    with pytest.raises(CpuLimitError, match="may only run on"):
        CpuLimit.first(len(available_cpus()) + 1)


def test_client_moves_off_the_servers_cpus() -> None:
    cpus = available_cpus()
    limit = CpuLimit((cpus[0],))
    with limit.client_elsewhere() as client:
        if len(cpus) == 1:
            assert client is None and os.sched_getaffinity(0) == set(cpus)
        else:
            assert client == cpus[1:] and os.sched_getaffinity(0) == set(cpus[1:])
    assert os.sched_getaffinity(0) == set(cpus)


# ------------------------------------------------------------------------ end to end
_HAS_SERVER = importlib.util.find_spec("hicache.server.serve") is not None


@pytest.mark.skipif(not _HAS_SERVER, reason="hicache.server.serve (hicache serve) is missing")
def test_compare_alternates_hicache_and_the_baseline(tmp_path: Path) -> None:
    """A real tiny `hicache serve` and the stand-in baseline, twice each, alternating."""
    args = compare_args(
        "--smoke", "--out-dir", str(tmp_path), "--configs", "l1", "--no-progress",
        "--num-clients", "2", "--num-rounds", "2", "--request-length", "48",
        "--baseline-command", FAKE_COMMAND, "--baseline-name", "fake",
        "--baseline-model", "/m/x", "--cpus", "1",
    )
    assert compare.main(args) == 0
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert [r["run"] for r in saved["runs"]] == ["l1.1", "fake.1", "l1.2", "fake.2"]
    for run in saved["runs"]:
        assert run["error"] is None, run
        assert len(run["load_before"]) == 3 and len(run["load_after"]) == 3
        summary = run["summary"]
        assert summary["overall"]["requests"] == 4 and summary["overall"]["failed"] == 0
        # hicache through /generate (hits by tier), the baseline through /v1/completions.
        api, tiers = summary["config"]["api"], summary["overall"]["tier_hit_rate"]
        assert (api, tiers is None) == (
            ("openai", True) if run["baseline"] else ("generate", False)
        ), run["run"]
    # Both sides returned their answers' token ids, which went into the next rounds'
    # prompts as they were: the two sides ran prompts of the same lengths.
    prompts = {a["name"]: a["prompt_tokens"] for a in saved["aggregates"]}
    assert prompts["l1"] == prompts["fake"] == 2 * (2 * 48 + 2 * (48 + 4 + 32))
    assert saved["warnings"] == []
    # Both servers ran on the limited CPU.
    pinned = CpuLimit.first(1).cpus[0]
    assert f"fake server cpus: [{pinned}]" in (tmp_path / "fake.1.server.log").read_text()
    assert {a["name"]: a["runs"] for a in saved["aggregates"]} == {"l1": 2, "fake": 2}
    [ratio] = saved["ratios"]
    assert ratio["name"] == "l1" and ratio["baseline"] == "fake"
    assert len(ratio["output_throughput_per_repeat"]) == 2
    l1, fake = (next(a for a in saved["aggregates"] if a["name"] == n) for n in ("l1", "fake"))
    assert ratio["output_throughput"] == pytest.approx(
        l1["output_throughput"] / fake["output_throughput"]
    )
    text = (tmp_path / "comparison.md").read_text()
    assert "## Runs in order" in text and "## hicache / fake" in text
    assert "| l1 / fake" in text and "taskset -c" in text
