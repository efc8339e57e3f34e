"""A prefill and a decode ``hicache serve`` (real processes, loopback) against one plain
``hicache serve``: greedy outputs equal, the bootstrap fields required, and with decode
offload the next turn's prefill finds the decode instance's pages in the shared L3."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.net import free_port
from hicache.testing.server_process import ChildServer, ServerProcess
from tests.dev_dependency import require_dev_dependency
from tests.pd_fixtures import (
    ADMIN_KEY,
    TIMEOUT_S,
    PDPair,
    check_integrity,
    pd_pair,
    plain_server,
)
from tests.waiting import wait_until

require_dev_dependency("mooncake.engine", "pip install 'hicache[mooncake]'")

PAGE = 16
ARGS = ["--device", "cpu", "--max-total-tokens", "2048", "--model-preset", "tiny",
        "--page-size", str(PAGE)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, PDPair]]:
    """A plain server (L3 of its own), and a PD pair sharing one file L3, decode offloading."""
    logs = tmp_path_factory.mktemp("pd-logs")
    plain_env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path_factory.mktemp("plain"))}
    pair_env = {**os.environ, "HICACHE_CACHE_DIR": str(tmp_path_factory.mktemp("shared"))}
    with ExitStack() as stack:
        plain = plain_server(ARGS, logs / "plain.log", env=plain_env)
        stack.callback(plain.stop)
        plain.launch()
        # Short prompts: prefetch any L3 hit (the default threshold is 256 tokens). Every
        # hit waited for and loaded, whatever it costs: on a slow machine the default
        # policies would recompute the pages the L3 test asserts were read.
        l3 = ["--hicache-storage-backend", "file",
              "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 0}',
              "--hicache-storage-prefetch-policy", "wait_complete",
              "--hicache-reuse-policy", "load"]
        pair = stack.enter_context(pd_pair(
            [*ARGS, *l3], logs, env=pair_env,
            decode_args=["--disaggregation-decode-enable-offload-kvcache"],
        ))
        plain.wait_ready()
        yield plain, pair


def _body(input_ids: list[int], max_new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}, **extra}


def _plain_generate(plain: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{plain.url}/generate", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(length)]


@pytest.mark.parametrize("length", [1, 15, 16, 17, 70])
def test_greedy_output_equals_a_plain_server(
    servers: tuple[ServerProcess, PDPair], length: int
) -> None:
    plain, pair = servers
    body = _body(_prompt(length, length), max_new_tokens=12)
    expected = _plain_generate(plain, body)["output_ids"]
    answer = pair.generate(body)
    assert answer["output_ids"] == expected
    assert answer["meta_info"]["completion_tokens"] == 12


def test_concurrent_requests_each_get_their_own_kv(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    plain, pair = servers
    bodies = [_body(_prompt(10 + 13 * i, 100 + i), max_new_tokens=6 + i) for i in range(6)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(pair.generate, bodies))
    for body, answer in zip(bodies, answers, strict=True):
        assert answer["output_ids"] == _plain_generate(plain, body)["output_ids"]


@pytest.mark.parametrize("sampling", [
    {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.8},
    {"temperature": 0.9, "top_k": 20, "sampling_seed": 1234},
    {"temperature": 0, "min_new_tokens": 5},
])
def test_penalties_and_seeded_sampling_match_a_plain_server(
    servers: tuple[ServerProcess, PDPair], sampling: dict[str, Any],
) -> None:
    plain, pair = servers
    body = {"input_ids": _prompt(33, 5), "sampling_params": {"max_new_tokens": 10, **sampling}}
    assert pair.generate(body)["output_ids"] == _plain_generate(plain, body)["output_ids"]


def _close(got: Any, expected: Any, path: str = "") -> None:
    """Equal structures, floats within 1e-4 (the same model on the same machine)."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-4), path
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            _close(a, b, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert set(got) == set(expected), path
        for key in expected:
            _close(got[key], expected[key], f"{path}.{key}")
    else:
        assert got == expected, path


_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                 "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


@pytest.mark.parametrize("start", [0, 5, -1])
def test_logprobs_equal_a_plain_server(
    servers: tuple[ServerProcess, PDPair], start: int
) -> None:
    """The prompt's and the first token's logprobs are the prefill instance's, handed to
    the decode instance with the first token; the rest are the decode instance's."""
    plain, pair = servers
    body = _body(_prompt(21, 8), max_new_tokens=7, return_logprob=True, top_logprobs_num=3,
                 token_ids_logprob=[5, 9], logprob_start_len=start)
    expected = _plain_generate(plain, body)
    answer = pair.generate(body)
    assert answer["output_ids"] == expected["output_ids"]
    for key in _LOGPROB_KEYS:
        _close(answer["meta_info"].get(key), expected["meta_info"].get(key), key)
    assert len(answer["meta_info"]["output_token_logprobs"]) == 7
    wanted = 0 if start == -1 else 21 - start
    assert len(answer["meta_info"].get("input_token_logprobs") or []) == wanted
    if start == 0:
        assert answer["meta_info"]["input_token_logprobs"][0][0] is None


def test_openai_logprobs_streamed_through_the_pair(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    plain, pair = servers
    chat = {"messages": [{"role": "user", "content": "name a page size"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    expected = httpx.post(f"{plain.url}/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
    _, got = pair.send("/v1/chat/completions", chat)
    assert got is not None and got.status_code == 200, got and got.text
    _close(got.json()["choices"][0]["logprobs"], expected.json()["choices"][0]["logprobs"])
    completion = {"prompt": "pages of KV", "max_tokens": 5, "temperature": 0, "logprobs": 2,
                  "ignore_eos": True, "stream": True}
    streams = [pair.send("/v1/completions", completion)[1],
               httpx.post(f"{plain.url}/v1/completions", json=completion, timeout=TIMEOUT_S)]
    tokens: list[list[Any]] = []
    for stream in streams:
        assert stream is not None and stream.status_code == 200
        chunks = [json.loads(line.removeprefix("data: ")) for line in stream.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        tokens.append([(c["choices"][0]["logprobs"]["tokens"],
                        c["choices"][0]["logprobs"]["token_logprobs"],
                        c["choices"][0]["logprobs"]["top_logprobs"])
                       for c in chunks if c["choices"] and c["choices"][0].get("logprobs")])
    assert sum(len(t[0]) for t in tokens[1]) == 5
    _close(tokens[0], tokens[1])


def test_logprobs_through_the_real_pd_router(
    servers: tuple[ServerProcess, PDPair], tmp_path: Path
) -> None:
    """``hicache router --pd-disaggregation`` in front of the pair: it adds the bootstrap
    fields and answers with the decode instance's reply, logprobs included."""
    plain, pair = servers
    port = free_port()
    command = [sys.executable, "-m", "hicache", "router", "--port", str(port),
               "--pd-disaggregation", "--prefill", pair.prefill.url, str(pair.bootstrap_port),
               "--decode", pair.decode.url, "--worker-startup-timeout", "30"]
    router = ChildServer(command, port, tmp_path / "router.log", startup_timeout_s=60,
                         stop_timeout_s=10, ready_paths=("/health",), name="the PD router")
    try:
        router.start()
        body = _body(_prompt(40, 9), max_new_tokens=5, return_logprob=True,
                     top_logprobs_num=2, logprob_start_len=30)
        got = httpx.post(f"{router.url}/generate", json=body, timeout=TIMEOUT_S)
        assert got.status_code == 200, got.text
        expected = _plain_generate(plain, body)
        assert got.json()["output_ids"] == expected["output_ids"]
        for key in _LOGPROB_KEYS:
            _close(got.json()["meta_info"].get(key), expected["meta_info"].get(key), key)
        chat = {"messages": [{"role": "user", "content": "and the page table?"}],
                "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1}
        got = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
        assert got.status_code == 200, got.text
        reference = httpx.post(f"{plain.url}/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
        _close(got.json()["choices"][0]["logprobs"], reference.json()["choices"][0]["logprobs"])
        samples = {**chat, "n": 2, "temperature": 0.8, "seed": 11, "logprobs": False}
        del samples["top_logprobs"]
        got = httpx.post(f"{router.url}/v1/chat/completions", json=samples, timeout=TIMEOUT_S)
        assert got.status_code == 200, got.text
        reference = httpx.post(f"{plain.url}/v1/chat/completions", json=samples,
                               timeout=TIMEOUT_S)
        assert [c["message"] for c in got.json()["choices"]] == [
            c["message"] for c in reference.json()["choices"]]
    finally:
        router.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_equal_a_plain_servers(
    servers: tuple[ServerProcess, PDPair], stream: bool
) -> None:
    """Each sample moves its KV in a room of its own, both instances deriving the same."""
    plain, pair = servers
    body = {"input_ids": _prompt(26, 4), "stream": stream, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.9, "top_k": 20, "sampling_seed": 99, "n": 3,
        "ignore_eos": True}}
    expected = httpx.post(f"{plain.url}/generate", json=body, timeout=TIMEOUT_S)
    prefill, decode = pair.send("/generate", body)
    assert prefill is not None and prefill.status_code == 200, prefill and prefill.text
    assert decode is not None and decode.status_code == 200, decode and decode.text

    def samples(response: httpx.Response) -> list[list[int]]:
        if not stream:
            return [item["output_ids"] for item in response.json()]
        by_index: dict[int, list[int]] = {}
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                by_index[chunk["index"]] = chunk["output_ids"]
        return [by_index[i] for i in sorted(by_index)]

    got = samples(decode)
    assert got == samples(expected) and len(got) == 3
    assert all(len(ids) == 6 for ids in got)
    assert len({tuple(ids) for ids in got}) > 1  # seeds 99, 100, 101: not one sample thrice
    assert [ids[:1] for ids in got] == [ids[:1] for ids in samples(prefill)]


def test_the_prefill_instance_answers_its_first_token_only(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    _, pair = servers
    prefill, decode = pair.send("/generate", _body(_prompt(30, 3), max_new_tokens=6))
    assert prefill is not None and decode is not None
    first = prefill.json()
    assert first["meta_info"]["completion_tokens"] == 1
    assert first["output_ids"] == decode.json()["output_ids"][:1]


def test_chat_and_completions_streamed_through_the_pair(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    plain, pair = servers
    chat = {"messages": [{"role": "user", "content": "tell me about pages"}], "max_tokens": 10,
            "temperature": 0}
    expected = httpx.post(f"{plain.url}/v1/chat/completions", json=chat, timeout=TIMEOUT_S)
    _, got = pair.send("/v1/chat/completions", chat)
    assert got is not None and got.status_code == 200, got and got.text
    assert got.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    completion = {"prompt": "a page of KV", "max_tokens": 9, "temperature": 0,
                  "ignore_eos": True}
    expected_text = httpx.post(f"{plain.url}/v1/completions", json=completion,
                               timeout=TIMEOUT_S).json()["choices"][0]["text"]
    _, streamed = pair.send("/v1/completions", {**completion, "stream": True})
    assert streamed is not None and streamed.status_code == 200
    pieces = [line.removeprefix("data: ") for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(p)["choices"][0]["text"] for p in pieces if json.loads(p)["choices"])
    assert text == expected_text


def test_requests_without_bootstrap_fields_are_refused(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    _, pair = servers
    for server in (pair.prefill, pair.decode):
        response = httpx.post(f"{server.url}/generate", json=_body([1, 2, 3]),
                              timeout=TIMEOUT_S)
        assert response.status_code == 400
        assert "bootstrap_room" in response.json()["error"]["message"]
    bad_room = {**_body([1, 2]), "bootstrap_host": "127.0.0.1",
                "bootstrap_port": pair.bootstrap_port, "bootstrap_room": -1}
    assert httpx.post(f"{pair.decode.url}/generate", json=bad_room,
                      timeout=TIMEOUT_S).status_code == 400


def test_server_info_reports_the_mode_and_bootstrap_port(
    servers: tuple[ServerProcess, PDPair],
) -> None:
    plain, pair = servers
    prefill = httpx.get(f"{pair.prefill.url}/get_server_info", timeout=TIMEOUT_S).json()
    decode = httpx.get(f"{pair.decode.url}/get_server_info", timeout=TIMEOUT_S).json()
    alone = httpx.get(f"{plain.url}/get_server_info", timeout=TIMEOUT_S).json()
    assert (prefill["disaggregation_mode"], prefill["disaggregation_bootstrap_port"]) == (
        "prefill", pair.bootstrap_port)
    assert decode["disaggregation_mode"] == "decode"
    assert alone["disaggregation_mode"] == "null"


def _backed_up_pages(server: ServerProcess) -> float:
    info = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT_S).json()
    counters = info["internal_states"][0]
    # Pages it wrote, and pages it found there already (the prefill instance's prompt).
    return float(counters["storage_backup_pages_stored"]
                 + counters["storage_backup_pages_existing"])


def test_decode_offload_lets_the_next_turn_hit_l3(servers: tuple[ServerProcess, PDPair]) -> None:
    plain, pair = servers
    turn1 = _prompt(40, 11)
    stored_before = _backed_up_pages(pair.decode)
    first = pair.generate(_body(turn1, max_new_tokens=30))
    assert first["output_ids"] == _plain_generate(plain, _body(turn1, max_new_tokens=30))[
        "output_ids"]
    context = turn1 + first["output_ids"]  # 70 tokens, 69 of them with KV on decode
    # The decode instance backs the finished request's pages up to the shared L3.
    # A hang guard of 120 s: the backup lands in well under that.
    assert wait_until(
        lambda: _backed_up_pages(pair.decode) >= stored_before + (len(context) - 1) // PAGE,
        120.0, poll_s=0.1,
    ), "the decode instance backed nothing up to L3"
    # The prefill instance forgets L1 and L2: what it reuses now comes from L3.
    # The instances have an admin key, which /flush_cache asks for.
    flushed = httpx.post(f"{pair.prefill.url}/flush_cache", timeout=TIMEOUT_S,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert flushed.status_code == 200, flushed.text
    turn2 = context + _prompt(20, 12)
    body = _body(turn2, max_new_tokens=10)
    prefill, decode = pair.send("/generate", body)
    assert prefill is not None and decode is not None and decode.status_code == 200
    storage = prefill.json()["meta_info"]["cached_tokens_details"]["storage"]
    # Pages past turn 1's prompt exist only because the decode instance wrote them.
    assert storage >= (len(context) - 1) // PAGE * PAGE > len(turn1) // PAGE * PAGE
    assert decode.json()["output_ids"] == _plain_generate(plain, body)["output_ids"]


def test_pools_are_consistent_after_all(servers: tuple[ServerProcess, PDPair]) -> None:
    plain, pair = servers
    for server in (plain, pair.prefill, pair.decode):
        check_integrity(server)
