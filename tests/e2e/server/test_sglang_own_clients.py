"""SGLang's own clients and router, unchanged, against ``hicache serve`` (tiny dummy model).

Runs only where the ``sglang`` package (its benchmark clients) and ``sglang_router``
can be imported: neither is a dependency of this project. Set them up in a
separate environment with ``pip install --no-deps sglang`` plus the modules its
benchmark imports, and ``pip install sglang-router``; then run this file with
that environment's Python. Everything stays on loopback; HF_HUB_OFFLINE keeps
the clients off the hub (they load the tokenizer from the server's tokenizer dir).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.net import free_port
from hicache.testing.server_process import ChildServer, ServerProcess

WORKER_ARGS = ("--load-format", "dummy", "--model-preset", "tiny", "--device", "cpu",
               "--max-total-tokens", "4096", "--page-size", "16",
               "--hicache-storage-backend", "none")
CLIENT_TIMEOUT_S = 240


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


needs_sglang = pytest.mark.skipif(
    not _importable("sglang.bench_serving"),
    reason="SGLang's benchmark clients are not installed (pip install --no-deps sglang, "
    "plus the modules sglang.bench_serving imports)",
)
needs_router = pytest.mark.skipif(
    not _importable("sglang_router"), reason="SGLang's router is not installed "
    "(pip install sglang-router)",
)


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HICACHE_CACHE_DIR": str(tmp_path / "cache")}


def _counters(url: str) -> dict[str, float]:
    """The cache's own counters: prompt tokens and cached tokens (every tier)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    prompt = float(re.search(r"^hicache_prompt_tokens_total (\S+)$", text, re.M)[1])  # type: ignore[index]
    cached = sum(float(v) for v in re.findall(r"^hicache_cached_tokens_total\{[^}]*\} (\S+)$",
                                              text, re.M))
    requests = float(re.search(r"^hicache_requests_total (\S+)$", text, re.M)[1])  # type: ignore[index]
    return {"prompt": prompt, "cached": cached, "requests": requests}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("sglang-clients")
    with ServerProcess(WORKER_ARGS, tmp / "worker.log", env=_env(tmp),
                       startup_timeout_s=120) as server:
        yield server


@needs_sglang
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_cache_report_matches_the_servers_counters(
    worker: ServerProcess, tmp_path: Path, backend: str
) -> None:
    before = _counters(worker.url)
    out = tmp_path / "result.jsonl"
    # No --tokenizer: bench_serving loads the one /model_info's tokenizer_path names.
    command = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", backend,
        "--host", "127.0.0.1", "--port", str(worker.port),
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "256",
        "--gsp-question-len", "32", "--gsp-output-len", "4", "--num-prompts", "6",
        "--max-concurrency", "2", "--cache-report", "--warmup-requests", "0",
        "--output-file", str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                         env=_env(tmp_path), stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    after = _counters(worker.url)
    assert result["completed"] == 6, run.stdout[-3000:]
    report = result["cache_report"]
    assert report["total_prompt_tokens"] == after["prompt"] - before["prompt"]
    assert report["total_cached_tokens"] == after["cached"] - before["cached"] > 0


@needs_sglang
def test_bench_multiturn_requests_report_the_servers_cache_hits(worker: ServerProcess) -> None:
    """bench_multiturn.py's own request and payload code (``sglang.test.kits.cache_hit_kit``:
    streamed /generate with token ids, history grown by the returned output_ids), three
    clients by three rounds; its cache hit rate is the server's, and each later round hits
    at least the previous round's prompt and output in whole pages (SGLang's expectation).
    (The kit's ``run_multiturn_cache_hit_test`` is not used: it samples from ShareGPT,
    which it downloads.)"""
    import asyncio

    from sglang.benchmark.datasets.random import sample_random_requests
    from sglang.benchmark.utils import get_tokenizer
    from sglang.test.kits.cache_hit_kit import async_request_sglang_generate, gen_payload

    info = httpx.get(f"{worker.url}/model_info").json()
    page_size = httpx.get(f"{worker.url}/server_info").json()["page_size"]
    tokenizer = get_tokenizer(info["tokenizer_path"])
    samples = sample_random_requests(
        input_len=96, output_len=8, num_prompts=3 * 3, range_ratio=1.0, tokenizer=tokenizer,
        dataset_path="", random_sample=False, return_text=False,
    )
    histories = [list(samples[i].prompt) for i in range(3)]
    questions = [list(row.prompt)[:24] for row in samples[3:]]
    assert httpx.post(f"{worker.url}/flush_cache").status_code == 200
    before = _counters(worker.url)
    prompt_total = cached_total = 0
    previous = [0, 0, 0]
    for round_index in range(3):
        async def one_round() -> list[Any]:
            return list(await asyncio.gather(*(
                async_request_sglang_generate(gen_payload(h, 8), f"{worker.url}/generate")
                for h in histories)))
        outputs = asyncio.run(one_round())
        for i, out in enumerate(outputs):
            assert out.success, out.error
            if round_index:
                floor = (previous[i] + 8 - 1) // page_size * page_size
                assert out.cached_tokens >= floor
            previous[i] = out.prompt_len
            prompt_total += out.prompt_len
            cached_total += out.cached_tokens
            if round_index < 2:
                histories[i] += list(out.output_ids) + questions.pop()
    after = _counters(worker.url)
    assert prompt_total == after["prompt"] - before["prompt"]
    assert cached_total == after["cached"] - before["cached"] > 0


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with ServerProcess(WORKER_ARGS, tmp_path / "a.log", env=_env(tmp_path / "a"),
                       startup_timeout_s=120) as a, \
         ServerProcess(WORKER_ARGS, tmp_path / "b.log", env=_env(tmp_path / "b"),
                       startup_timeout_s=120) as b:
        yield a, b


class _SGLangRouter(ChildServer):
    """SGLang's router, ready once a /generate through it reaches a worker (it answers
    its own routes before it has checked its workers)."""

    poll_interval_s = 0.5

    def ready(self) -> bool:
        try:
            return httpx.post(f"{self.url}/generate", timeout=10.0, json={
                "text": "ping", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        except httpx.TransportError:
            return False

    def awaited(self) -> str:
        return f"route a /generate on port {self.port}"


def _start_router(policy: str, workers: tuple[ServerProcess, ...], log: Path) -> ChildServer:
    port = free_port()
    router = _SGLangRouter(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", policy, "--log-level", "info",
         "--worker-urls", *(w.url for w in workers)],
        port, log, env={**os.environ, "HF_HUB_OFFLINE": "1"}, startup_timeout_s=60,
        stop_timeout_s=15, name="SGLang's router",
    )
    router.start()
    return router


@needs_router
def test_router_cache_aware_keeps_a_conversation_on_one_worker_round_robin_spreads(
    two_workers: tuple[ServerProcess, ServerProcess], tmp_path: Path
) -> None:
    for policy in ("cache_aware", "round_robin"):
        log = tmp_path / f"router-{policy}.log"
        router = _start_router(policy, two_workers, log)
        url = router.url
        try:
            before = [_counters(w.url) for w in two_workers]
            if policy == "cache_aware":
                history = "a conversation that keeps growing, turn after turn. " * 8
                for turn in range(4):
                    history += f" question {turn}?"
                    answer = httpx.post(f"{url}/generate", timeout=60.0, json={
                        "text": history, "sampling_params": {"max_new_tokens": 4,
                                                             "ignore_eos": True}})
                    assert answer.status_code == 200, answer.text
                    history += answer.json()["text"]
            else:
                for i in range(4):
                    reply = httpx.post(f"{url}/v1/completions", timeout=60.0, json={
                        "model": "dummy-tiny", "prompt": f"unrelated prompt number {i}",
                        "max_tokens": 2})
                    assert reply.status_code == 200, reply.text
            # Streaming through the router, both APIs.
            with httpx.Client(timeout=60.0) as client:
                with client.stream("POST", f"{url}/generate", json={
                        "text": "stream me", "stream": True,
                        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}) as s:
                    lines = [x for x in s.iter_lines() if x.startswith("data: ")]
                assert s.status_code == 200 and lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2][6:])["meta_info"]["completion_tokens"] == 3
                with client.stream("POST", f"{url}/v1/chat/completions", json={
                        "model": "dummy-tiny", "stream": True, "max_tokens": 3,
                        "messages": [{"role": "user", "content": "hi"}]}) as s:
                    lines = [x for x in s.iter_lines() if x.startswith("data: ")]
                assert s.status_code == 200 and lines[-1] == "data: [DONE]"
            after = [_counters(w.url) for w in two_workers]
        finally:
            router.stop()
        requests = [after[i]["requests"] - before[i]["requests"] for i in range(2)]
        hits = [after[i]["cached"] - before[i]["cached"] for i in range(2)]
        text = log.read_text(errors="replace")
        assert "circuit" not in text.lower() or "open" not in text.lower(), text[-3000:]
        assert " ERROR " not in re.sub(r"\x1b\[[0-9;]*m", "", text), text[-3000:]
        if policy == "cache_aware":
            # The 4 turns (plus the 2 streams, routed by their own text) went where the
            # conversation's prefix is cached: one worker holds every hit.
            assert min(hits) == 0 and max(hits) > 0, (requests, hits)
        else:
            # 4 completions + 2 streams, alternating.
            assert requests == [3, 3], requests
