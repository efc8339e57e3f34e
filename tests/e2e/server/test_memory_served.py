"""``hicache serve`` with no pool flag on a machine with little memory: it starts, sizes
its pools to what is available, says so (log, /get_server_info, /metrics), answers the
README's two examples, and its engine process stays within what it announced.

The machine's available memory is capped with ``HICACHE_AVAILABLE_MEMORY`` (the
engine reads it after loading the weights, where MemAvailable would no longer count
them): 900 MB is what a machine with ~3 GB MemAvailable has left once the server
process and SmolLM2's engine process are loaded. Before the pools were sized, the
default took a 3.0 GB device pool and a 6.0 GB host pool whatever the machine had.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import time
from pathlib import Path

import httpx

from hicache.engine.config import CPU_KV_POOL_TOKENS
from hicache.memory.machine_memory import AVAILABLE_MEMORY_ENV, resident_bytes
from hicache.model.gguf_cache import ConvertedModel
from hicache.testing.server_process import ServerProcess

AVAILABLE = 900 << 20
MODEL = "SmolLM2-135M-Instruct"


def _engine_pid(server_pid: int) -> int:
    """The engine process ``hicache serve`` spawned (the one child running spawn_main)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine process under {server_pid}")


def _prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocabulary = ["cache", "page", "tree", "host", "device", "token", "river", "stone",
                  "music", "garden", "winter", "signal", "ocean", "paper", "engine"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_default_server_fits_a_small_machine_and_stays_within_its_announcement(
    smollm2: ConvertedModel, tmp_path: Path,
) -> None:
    env = {**os.environ, "HICACHE_CACHE_DIR": str(smollm2.path.parent.parent),
           AVAILABLE_MEMORY_ENV: str(AVAILABLE)}
    with ServerProcess(["--device", "cpu"], tmp_path / "serve.log", env=env,
                       startup_timeout_s=300) as server:
        assert server.process is not None
        engine = _engine_pid(server.process.pid)
        info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
        memory = info["memory"]
        assert memory["source"] == "auto"
        # The cap, or less where the machine really has less.
        assert memory["available_bytes"] <= AVAILABLE
        pools = memory["device_pool_bytes"] + memory["host_pool_bytes"]
        # Both pools are host memory on the CPU, and fit what was available past the reserve.
        assert memory["device_pool_in_host_memory"] is True
        assert pools <= AVAILABLE - memory["reserve_bytes"]
        assert 0 < memory["device_pool_tokens"] < CPU_KV_POOL_TOKENS
        assert memory["host_pool_bytes"] == 2 * memory["device_pool_bytes"]
        assert memory["announced_bytes"] == (
            memory["resident_at_sizing_bytes"] + memory["reserve_bytes"] + pools
        )
        assert info["max_total_num_tokens"] == memory["device_pool_tokens"]

        # The README's two examples.
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
        assert chat.status_code == 200, chat.text
        assert "Paris" in chat.json()["choices"][0]["message"]["content"]
        italy = httpx.post(f"{server.url}/generate", timeout=120, json={
            "text": "The capital of Italy is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        })
        assert italy.status_code == 200, italy.text
        assert "Rome" in italy.json()["text"]

        # Distinct prompts worth more than both pools, four at a time: the device pool
        # fills and evicts to the host pool, which fills too.
        pool_tokens = 3 * memory["device_pool_tokens"]
        count = 4 + pool_tokens // 600

        def ask(seed: int) -> int:
            reply = httpx.post(f"{server.url}/generate", timeout=600, json={
                "text": _prompt(seed, 500),
                "sampling_params": {"max_new_tokens": 16, "temperature": 0},
                # Every third one asks the prompt's logprobs: a step's logits for every
                # prompt token, the largest activations the engine makes.
                **({"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5}
                   if seed % 3 == 0 else {}),
            })
            return reply.status_code

        peak = 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(ask, seed) for seed in range(count)]
            while not all(future.done() for future in futures):
                peak = max(peak, resident_bytes(engine) or 0)
                time.sleep(0.05)  # the sampling period of the peak, not a wait
            assert [future.result() for future in futures] == [200] * count
        peak = max(peak, resident_bytes(engine) or 0)

        info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
        counters = info["internal_states"][0]
        # The host pool was used, not merely reserved.
        assert counters["host_pool_used_pages"] >= counters["host_pool_pages"] // 2
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log_text()

    # The engine process held no more than it announced, and its growth past what it held
    # when it sized the pools no more than the machine had available.
    assert peak <= memory["announced_bytes"], (peak, memory)
    assert peak - memory["resident_at_sizing_bytes"] <= AVAILABLE
    assert re.search(r"^hicache_memory_auto_sized 1\.0$", metrics, re.MULTILINE)
    for gauge in ("device_pool_bytes", "host_pool_bytes", "announced_bytes"):
        assert re.search(rf"^hicache_memory_{gauge} \d", metrics, re.MULTILINE), gauge
    sizing = [line for line in log.splitlines() if "memory: available" in line]
    assert len(sizing) == 1, log
    assert "shrunk to fit" in sizing[0]
    assert (f"({AVAILABLE_MEMORY_ENV};" in sizing[0]) is (memory["available_bytes"] == AVAILABLE)
