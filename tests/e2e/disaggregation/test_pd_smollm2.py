"""SmolLM2 (the default model) served by a prefill and a decode instance answers exactly
as one plain ``hicache serve`` does, greedy."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from hicache.model.gguf_cache import ConvertedModel
from tests.dev_dependency import require_dev_dependency
from tests.pd_fixtures import TIMEOUT_S, check_integrity, pd_pair, plain_server

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

ARGS = ["--device", "cpu", "--max-total-tokens", "4096", "--hicache-storage-backend", "none"]
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}


def test_smollm2_through_prefill_and_decode_equals_one_server(
    smollm2: ConvertedModel, tmp_path: Path
) -> None:
    env = {**os.environ, "HICACHE_CACHE_DIR": str(smollm2.path.parent.parent)}
    with ExitStack() as stack:
        plain = plain_server(ARGS, tmp_path / "plain.log", env=env, startup_timeout_s=240)
        stack.callback(plain.stop)
        plain.launch()
        pair = stack.enter_context(pd_pair(ARGS, tmp_path, env=env, startup_timeout_s=240))
        plain.wait_ready()
        expected = httpx.post(f"{plain.url}/v1/chat/completions", json=CHAT, timeout=TIMEOUT_S)
        assert expected.status_code == 200, expected.text
        _, got = pair.send("/v1/chat/completions", CHAT)
        assert got is not None and got.status_code == 200, got and got.text
        answer = got.json()["choices"][0]
        assert answer["message"] == expected.json()["choices"][0]["message"]
        assert "Paris" in answer["message"]["content"]
        # Logprobs: the first token's from the prefill instance, the rest from the decode one.
        with_logprobs = {**CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
        expected = httpx.post(f"{plain.url}/v1/chat/completions", json=with_logprobs,
                              timeout=TIMEOUT_S)
        _, got = pair.send("/v1/chat/completions", with_logprobs)
        assert got is not None and got.status_code == 200, got and got.text
        mine = got.json()["choices"][0]["logprobs"]["content"]
        theirs = expected.json()["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in mine] == [t["token"] for t in theirs] and len(mine) == 6
        for a, b in zip(mine, theirs, strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            tops = [[t["token"] for t in x["top_logprobs"]] for x in (a, b)]
            assert tops[0] == tops[1] and len(tops[0]) == 3
        # A prompt over several pages, by token ids.
        body = {"input_ids": list(range(100, 180)),
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        alone = httpx.post(f"{plain.url}/generate", json=body, timeout=TIMEOUT_S).json()
        assert pair.generate(body)["output_ids"] == alone["output_ids"]
        for server in (pair.prefill, pair.decode):
            check_integrity(server)
