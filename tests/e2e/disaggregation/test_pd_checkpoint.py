"""A transformers-made checkpoint served by a prefill and a decode instance answers exactly as
transformers' own greedy decoding and one plain ``hicache serve`` do: the KV the prefill
instance computed and wrote into the decode instance's pool is the KV decode needs."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.dev_dependency import require_dev_dependency
from tests.hf_checkpoints import hf_greedy_decode, variants, write_checkpoint
from tests.pd_fixtures import TIMEOUT_S, check_integrity, pd_pair, plain_server

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

PAGE = 4
STEPS = 8


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qknorm-tied"])
def test_checkpoint_through_prefill_and_decode_equals_transformers_and_one_server(
    variant: str, tmp_path: Path
) -> None:
    checkpoint = write_checkpoint(variants()[variant], tmp_path / "model")
    args = ["--device", "cpu", "--model-path", str(checkpoint.path), "--dtype", "float32",
            "--max-total-tokens", "1024", "--page-size", str(PAGE),
            "--hicache-storage-backend", "none"]
    env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path / "cache")}
    # Prompts of less than a page, exactly pages, and pages and a part.
    prompts = [[5, 9, 2], list(range(10, 10 + 3 * PAGE)), list(range(40, 40 + 5 * PAGE + 1))]
    with ExitStack() as stack:
        plain = plain_server(args, tmp_path / "plain.log", env=env)
        stack.callback(plain.stop)
        plain.launch()
        pair = stack.enter_context(pd_pair(args, tmp_path, env=env))
        plain.wait_ready()
        for prompt in prompts:
            body = {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}}
            expected, _ = hf_greedy_decode(checkpoint.hf, prompt, STEPS)
            alone = httpx.post(f"{plain.url}/generate", json=body, timeout=TIMEOUT_S)
            assert alone.status_code == 200, alone.text
            got = pair.generate(body)["output_ids"]
            assert got == alone.json()["output_ids"] == expected, (prompt, got, expected)
        for server in (pair.prefill, pair.decode):
            check_integrity(server)
