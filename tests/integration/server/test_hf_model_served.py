"""A Hugging Face model directory served by hicache answers exactly what transformers computes.

The directory is made in the test: a random Qwen3 checkpoint written by
transformers' ``save_pretrained`` plus a BPE tokenizer with a chat template.
The server loads it with ``--model-path`` (no hub access), and the official
OpenAI client's greedy chat answer must be transformers' own greedy decode of
the same chat-templated prompt, cold and again from the cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.hf_checkpoints import Checkpoint, hf_greedy_decode, variants, write_checkpoint
from tests.server_fixtures import RunningServer, serve_in_thread
from tests.unit.model.test_hf_tokenizer import write_tokenizer

STEPS = 8
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does a cache hierarchy buy a long conversation?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = tmp_path_factory.mktemp("qwen3-tiny")
    write_tokenizer(path)
    return write_checkpoint(variants()["qwen3-qknorm-tied"], path)


@pytest.fixture(scope="module")
def server(checkpoint: Checkpoint) -> Iterator[RunningServer]:
    with serve_in_thread(["--model-path", str(checkpoint.path), "--enable-hierarchical-cache"]) \
            as running:
        yield running


def test_chat_answer_equals_transformers_greedy_decode(
    checkpoint: Checkpoint, server: RunningServer
) -> None:
    reference = AutoTokenizer.from_pretrained(checkpoint.path)
    prompt = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # transformers 5 may return a BatchEncoding
        prompt = list(prompt["input_ids"])
    expected, _ = hf_greedy_decode(checkpoint.hf, prompt, STEPS)

    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == checkpoint.path.name
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answers = []
    for _ in range(2):  # cold, then with the prompt's prefix cached
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=STEPS, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
        answers.append(chat)
    assert answers[0].usage is not None and answers[1].usage is not None
    assert answers[0].usage.prompt_tokens == len(prompt)
    assert answers[0].usage.completion_tokens == STEPS
    cached = answers[1].usage.prompt_tokens_details
    assert cached is not None and cached.cached_tokens and cached.cached_tokens > 0
    text = reference.decode(expected)
    assert [a.choices[0].message.content for a in answers] == [text, text]

    # The same prompt as token ids through /generate: the exact tokens.
    response = httpx.post(f"{server.url}/generate", timeout=30, json={
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True},
    })
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == expected
