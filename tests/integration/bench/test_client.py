"""The streaming client and the session runner against a fake server on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.bench.client import ApiStyle, BenchClient, GenerateStream, RequestResult
from hicache.bench.multiturn import Pacing, run_sessions
from hicache.bench.report import JsonlLog, RequestRecord, RunSummary, read_jsonl
from hicache.bench.workload import (
    ArrivalDistribution,
    PromptMaker,
    PromptStyle,
    Session,
    multiturn_sessions,
)
from hicache.cli import main as cli_main
from tests.bench_fake_server import FakeState, fake_server


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeState]]:
    with fake_server() as running:
        yield running


@pytest.fixture
def state(server: tuple[str, FakeState]) -> Iterator[FakeState]:
    _, st = server
    # Each test starts from the default schedule and an empty "cache".
    st.ttft_s, st.itl_s, st.tokens_per_chunk, st.empty_first_chunk = 0.05, 0.005, 1, True
    st.prompts.clear()
    st.received.clear()
    st.max_inflight = 0
    yield st


def send(url: str, api: ApiStyle, prompt: list[int] | str, max_tokens: int) -> RequestResult:
    async def go() -> RequestResult:
        async with BenchClient(url, api) as client:
            return await client.send(prompt, max_tokens)

    return asyncio.run(go())


@pytest.mark.parametrize("api", list(ApiStyle))
def test_stream_timing_tokens_and_cache(
    server: tuple[str, FakeState], state: FakeState, api: ApiStyle
) -> None:
    url, _ = server
    prompt = list(range(40))
    first = send(url, api, prompt, 8)
    assert first.ok, first.error
    assert first.output_tokens == 8
    assert first.text == "ABCDEFGH"
    assert first.prompt_tokens == 40
    assert first.cached_tokens == 0
    # TTFT is the scripted wait before the first token, not the earlier empty chunk.
    assert first.ttft_from_content
    assert first.ttft_s is not None and 0.05 <= first.ttft_s < first.latency_s
    assert len(first.itl_s) == 7
    assert all(gap > 0 for gap in first.itl_s)
    assert first.latency_s >= 0.05 + 7 * 0.005

    # The same prompt plus more: the fake caches the shared 40 tokens.
    second = send(url, api, [*prompt, 1, 2, 3], 2)
    assert second.ok and second.cached_tokens == 40
    if api is ApiStyle.GENERATE:
        assert second.cached_by_tier == {"device": 40, "host": 0, "storage": 0}
        assert second.output_ids == [65, 66]
    else:
        assert second.cached_by_tier is None  # the OpenAI API has no tiers

    body = state.received[0]
    if api is ApiStyle.OPENAI:
        assert body["prompt"] == prompt and body["max_tokens"] == 8 and body["stream"]
        assert body["model"] == "fake-model"  # from /v1/models
        assert body["stream_options"] == {"include_usage": True}
    else:
        assert body["input_ids"] == prompt
        assert body["sampling_params"]["max_new_tokens"] == 8
        assert body["sampling_params"]["ignore_eos"] is True


def test_text_prompts_are_sent_as_text(server: tuple[str, FakeState], state: FakeState) -> None:
    url, _ = server
    result = send(url, ApiStyle.GENERATE, " hello world", 3)
    assert result.ok and result.prompt_tokens == len(" hello world")
    assert state.received[-1]["text"] == " hello world"


def test_chunks_with_several_tokens_spread_the_gap(
    server: tuple[str, FakeState], state: FakeState
) -> None:
    url, _ = server
    state.tokens_per_chunk = 3
    state.itl_s = 0.01
    result = send(url, ApiStyle.GENERATE, [1, 2, 3], 9)
    assert result.ok and result.output_tokens == 9
    # 3 chunks: 2 gaps between them (about 30 ms; how long exactly, a busy machine decides),
    # each counted for its 3 tokens as three equal thirds.
    assert len(result.itl_s) == 6
    for spread in (result.itl_s[:3], result.itl_s[3:]):
        assert spread[0] > 0 and spread == [spread[0]] * 3, result.itl_s
    assert result.text == "ABCDEFGHI"


def test_http_error_is_a_failed_result(server: tuple[str, FakeState], state: FakeState) -> None:
    url, _ = server
    result = send(url, ApiStyle.OPENAI, [1, 2], 5000)
    assert not result.ok
    assert result.error is not None and "HTTP 400" in result.error and "too large" in result.error
    assert result.ttft_s is None


def test_unreachable_server_is_a_failed_result() -> None:
    # A port nobody listens on (bound, never listening).
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = send(url, ApiStyle.GENERATE, [1], 1)
    assert not result.ok and result.error


def test_generate_stream_parser_reads_incremental_chunks() -> None:
    # Servers that stream deltas instead of SGLang's cumulative chunks.
    stream = GenerateStream(sent_at=0.0)
    stream.feed({"text": "A", "output_ids": [65], "meta_info": {"completion_tokens": 1}}, 0.1)
    stream.feed({"text": "B", "output_ids": [66], "meta_info": {"completion_tokens": 2}}, 0.2)
    stream.feed({"text": "C", "output_ids": [67], "meta_info": {
        "completion_tokens": 3, "finish_reason": "length"}}, 0.3)
    result = stream.result(0.3, done=False)
    assert result.ok and result.text == "ABC" and result.output_ids == [65, 66, 67]
    assert result.output_tokens == 3 and result.finish_reason == "length"
    assert result.ttft_s == pytest.approx(0.1)
    assert result.itl_s == pytest.approx([0.1, 0.1])


def test_stream_without_visible_output_falls_back_to_the_end() -> None:
    # A dummy model's tokens may decode to no text: TTFT is then the end, flagged.
    from hicache.bench.client import OpenAIStream

    stream = OpenAIStream(sent_at=1.0)
    stream.feed({"choices": [{"text": "", "finish_reason": "length"}]}, 1.5)
    stream.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}, 1.6)
    result = stream.result(1.7, done=True)
    assert result.ok and not result.ttft_from_content
    assert result.ttft_s == pytest.approx(0.7) and result.output_tokens == 1


def test_openai_token_ids_are_the_answer_and_time_the_first_token() -> None:
    # vLLM with return_token_ids: a token ending inside a character streams as a chunk
    # with ids and no text; it is output all the same (as /generate counts it).
    from hicache.bench.client import OpenAIStream

    stream = OpenAIStream(sent_at=1.0)
    stream.feed({"choices": [{"text": "", "token_ids": [200], "finish_reason": None}]}, 1.2)
    stream.feed({"choices": [{"text": "é", "token_ids": [201], "finish_reason": None}]}, 1.3)
    stream.feed({"choices": [{"text": "x", "token_ids": [120, 121], "finish_reason": "length"}]},
                1.5)
    stream.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}, 1.6)
    result = stream.result(1.7, done=True)
    assert result.ok and result.ttft_from_content and result.ttft_s == pytest.approx(0.2)
    assert result.output_ids == [200, 201, 120, 121] and result.text == "éx"
    assert result.itl_s == pytest.approx([0.1, 0.1, 0.1])
    assert result.output_tokens == 4


def test_openai_client_asks_for_token_ids_when_told(
    server: tuple[str, FakeState], state: FakeState
) -> None:
    url, _ = server

    async def go(ids: bool) -> RequestResult:
        async with BenchClient(url, ApiStyle.OPENAI, return_token_ids=ids) as client:
            return await client.send(list(range(10)), 3)

    plain = asyncio.run(go(False))
    assert "return_token_ids" not in state.received[-1] and plain.output_ids is None
    with_ids = asyncio.run(go(True))
    assert state.received[-1]["return_token_ids"] is True
    assert with_ids.output_ids == [65, 66, 67] and with_ids.text == "ABC"


def test_truncated_stream_is_a_failure() -> None:
    stream = GenerateStream(sent_at=0.0)
    stream.feed({"text": "A", "output_ids": [65], "meta_info": {"completion_tokens": 1}}, 0.1)
    result = stream.result(0.2, done=False)
    assert not result.ok and "ended before" in (result.error or "")


# ------------------------------------------------------------------------ runner
def _run(
    url: str, api: ApiStyle, pacing: Pacing, log: Path | None = None, **workload: int
) -> tuple[list[RequestRecord], list[Session]]:
    maker = PromptMaker(PromptStyle.TOKENS)
    sessions = multiturn_sessions(maker=maker, seed=3, **workload)

    async def go() -> list[RequestRecord]:
        async with BenchClient(url, api) as client:
            with JsonlLog(log) as jsonl:
                return await run_sessions(client, sessions, pacing, maker, jsonl)

    return asyncio.run(go()), sessions


@pytest.mark.parametrize("api", list(ApiStyle))
def test_multiturn_appends_answers_and_hits_the_cache(
    server: tuple[str, FakeState], state: FakeState, api: ApiStyle, tmp_path: Path
) -> None:
    url, _ = server
    state.ttft_s = 0.01
    log = tmp_path / "log.jsonl"
    records, sessions = _run(
        url, api, Pacing(max_inflight=2), log, num_clients=3, num_rounds=3, request_length=50,
        sub_question_length=10, output_length=4,
    )
    assert len(records) == 9 and all(r.ok for r in records)
    assert state.max_inflight <= 2
    by_key = {(r.session, r.round): r for r in records}
    for s in sessions:
        assert s.done
        assert by_key[(s.index, 0)].prompt_tokens == 50
        # Each round adds the 4-token answer and a 10-token question.
        assert by_key[(s.index, 1)].prompt_tokens == 64
        assert by_key[(s.index, 2)].prompt_tokens == 78
        # Later rounds find the whole previous prompt plus answer cached.
        assert by_key[(s.index, 1)].cached_tokens == 54
        assert by_key[(s.index, 2)].cached_tokens == 68
    # What the server got: round r+1's prompt = round r's prompt + "ABCD" + question.
    key = "prompt" if api is ApiStyle.OPENAI else "input_ids"
    prompts = [b[key] for b in state.received]
    for p in prompts:
        if len(p) > 50:
            parent = next(q for q in prompts if len(q) == len(p) - 14 and p[: len(q)] == q)
            assert p[len(parent) : len(parent) + 4] == [65, 66, 67, 68]
    logged = read_jsonl(log)
    assert sorted((r.session, r.round) for r in logged) == sorted(by_key)
    summary = RunSummary.of("run", records)
    assert summary.rounds[0].hit_rate == 0
    assert summary.rounds[2].hit_rate == pytest.approx(68 / 78)


def test_round_barrier_holds_the_next_round(
    server: tuple[str, FakeState], state: FakeState
) -> None:
    url, _ = server
    state.ttft_s = 0.01
    records, _ = _run(
        url, ApiStyle.GENERATE, Pacing(round_barrier=True), None, num_clients=4, num_rounds=3,
        request_length=20, sub_question_length=5, output_length=2,
    )
    for r in range(2):
        last_end = max(x.ended_s for x in records if x.round == r)
        first_next = min(x.sent_s for x in records if x.round == r + 1)
        assert first_next >= last_end


def test_uniform_rate_spaces_the_sends(server: tuple[str, FakeState], state: FakeState) -> None:
    url, _ = server
    state.ttft_s = 0.0
    records, _ = _run(
        url, ApiStyle.GENERATE,
        Pacing(request_rate=20.0, distribution=ArrivalDistribution.UNIFORM),
        None, num_clients=6, num_rounds=1, request_length=10, sub_question_length=0,
        output_length=1,
    )
    sends = sorted(r.sent_s for r in records)
    assert len(sends) == 6
    # Never sooner than planned: the first a gap after the start, then each a gap after
    # the one before (1/20 s, minus timer slack).
    gaps = [b - a for a, b in itertools.pairwise([0.0, *sends])]
    assert all(gap >= 0.045 for gap in gaps)
    # Nor much later: planned to end at 0.3 s. Each gap counts from the send before, so a
    # loaded machine's timer overshoots add up; a rate mistaken for a gap (20 s each)
    # would be far over this.
    assert sends[-1] < 3.0


def test_multiturn_cli_writes_log_and_summary(
    server: tuple[str, FakeState], state: FakeState, tmp_path: Path
) -> None:
    url, _ = server
    state.ttft_s = 0.005
    out, log = tmp_path / "run.json", tmp_path / "run.jsonl"
    code = cli_main([
        "bench", "multiturn", "--url", url, "--api", "generate", "--num-clients", "2",
        "--num-rounds", "2", "--request-length", "30", "--sub-question-length", "5",
        "--output-length", "3", "--json-out", str(out), "--log-file", str(log),
        "--no-progress", "--label", "fake", "--flush-cache",
    ])
    assert code == 0
    summary = RunSummary.load(out)
    assert summary.label == "fake" and summary.overall.requests == 4
    assert summary.overall.failed == 0 and summary.overall.output_tokens == 12
    assert summary.config["num_clients"] == 2 and summary.config["request_rate"] == "inf"
    assert len(summary.rounds) == 2 and summary.rounds[1].hit_rate is not None
    assert summary.rounds[1].hit_rate > 0.5
    assert len(log.read_text().splitlines()) == 4
    assert state.flushes >= 1
    # The warm-up request went first and is not in the log.
    assert len(state.received) == 5
    assert json.loads(out.read_text())["overall"]["ttft_s"]["count"] == 4


def test_long_context_cli_shares_contexts(
    server: tuple[str, FakeState], state: FakeState, tmp_path: Path
) -> None:
    url, _ = server
    state.ttft_s = 0.005
    out = tmp_path / "lc.json"
    code = cli_main([
        "bench", "long-context", "--url", url, "--api", "openai", "--num-contexts", "2",
        "--context-length", "100", "--questions-per-context", "3", "--question-length", "8",
        "--output-length", "2", "--max-inflight", "1", "--json-out", str(out),
        "--no-progress", "--warmup", "0",
    ])
    assert code == 0
    summary = RunSummary.load(out)
    assert summary.overall.requests == 6 and summary.overall.prompt_tokens == 6 * 108
    # One request at a time, round-robin: the first question of each context misses,
    # the other four find their 100-token context cached.
    assert summary.overall.cached_tokens == 4 * 100
    assert not math.isnan(summary.input_throughput) and summary.input_throughput > 0


def test_cli_reports_an_unreachable_server(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        code = cli_main([
            "bench", "multiturn", "--url", url, "--num-clients", "1", "--num-rounds", "1",
            "--request-length", "4", "--no-progress", "--request-timeout", "5",
        ])
    assert code == 2


def test_generate_stream_parser_reads_cumulative_text_alone() -> None:
    # Neither ids nor counts: growth of the cumulative text marks each token.
    stream = GenerateStream(sent_at=0.0)
    stream.feed({"text": "A"}, 0.1)
    stream.feed({"text": "AB"}, 0.2)
    stream.feed({"text": "AB", "meta_info": {"finish_reason": {"type": "stop"}}}, 0.3)
    result = stream.result(0.3, done=True)
    assert result.ok and result.text == "AB" and result.output_tokens == 2
    assert result.finish_reason == "stop" and result.output_ids is None
    assert result.itl_s == pytest.approx([0.1])


def test_multiturn_cli_takes_sglang_bench_multiturn_flags(
    server: tuple[str, FakeState], state: FakeState, tmp_path: Path
) -> None:
    """SGLang's bench_multiturn.py command line (its flag names) runs unchanged."""
    url, _ = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    state.ttft_s = 0.005
    out = tmp_path / "run.json"
    code = cli_main([
        "bench", "multiturn", "--host", host, "--port", port, "--api-format", "sglang",
        "--num-clients", "2", "--max-parallel", "1", "--request-length", "30",
        "--sub-question-input-length", "5", "--output-length", "3", "--num-rounds", "2",
        "--enable-round-barrier", "--request-rate", "100", "--json-out", str(out),
        "--no-progress",
    ])
    assert code == 0
    summary = RunSummary.load(out)
    assert summary.overall.requests == 4 and summary.overall.failed == 0
    config = summary.config
    assert config["api"] == "generate" and config["max_inflight"] == 1
    assert config["sub_question_length"] == 5 and config["round_barrier"] is True
    assert {r["route"] for r in state.received} == {"generate"}
