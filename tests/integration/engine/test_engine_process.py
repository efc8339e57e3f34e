"""The engine in a process of its own (EngineClient): same outputs as in process, control
calls across the pipe, bad requests refused before sending, start failures reported, and an
engine process that dies fails its requests at once instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.config import CacheConfig
from hicache.engine.api import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.config import EngineConfig, ModelLoadConfig, SchedulingConfig
from hicache.engine.engine_client import (
    CALL_TIMEOUT_S,
    EngineClient,
    EngineDeadError,
    EngineStartError,
)
from hicache.storage.base import StorageError
from tests.waiting import wait_until

CONFIG = EngineConfig(
    model=ModelLoadConfig(preset="tiny", device="cpu"),
    scheduling=SchedulingConfig(max_total_tokens=2048),
    cache=CacheConfig(page_size=16, enable_hierarchical_cache=True),
)
PROMPTS = [tuple(range(3, 40)), (*range(3, 40), 7, 8, 9), tuple(range(50, 90))]
# A dead engine's streams end when its pipe closes, not at a call's timeout
# (CALL_TIMEOUT_S): the bound sits between the two, generous for a busy machine.
FAILS_WITHIN_S = CALL_TIMEOUT_S / 2
# Waits for what follows in the background: guards against a hang, not bounds.
SETTLE_S = 60.0


def _requests() -> list[GenerateRequest]:
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                            ignore_eos=True)
    return [GenerateRequest(input_ids=p, sampling=s, rid=f"r{i}-{j}")
            for i, p in enumerate(PROMPTS) for j, s in enumerate((greedy, seeded))]


async def _collect(engine: object, request: GenerateRequest) -> list[GenerateOutput]:
    return [out async for out in engine.generate(request)]  # type: ignore[attr-defined]


async def _run_all(engine: object) -> list[list[GenerateOutput]]:
    # One at a time: the second prompt reuses the first's cached prefix in both engines.
    return [await _collect(engine, request) for request in _requests()]


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    engine = EngineClient(CONFIG).start()
    try:
        yield engine
    finally:
        engine.shutdown()


def test_outputs_equal_the_in_process_engine(client: EngineClient) -> None:
    local = build_engine(CONFIG)
    try:
        expected = asyncio.run(_run_all(local))
    finally:
        local.shutdown()
    got = asyncio.run(_run_all(client))
    for want, have in zip(expected, got, strict=True):
        assert [o.token_ids for o in have] != []
        assert sum((o.token_ids for o in have), ()) == sum((o.token_ids for o in want), ())
        assert "".join(o.text for o in have) == "".join(o.text for o in want)
        assert have[-1].finished and have[-1].finish_reason == "length"
        assert have[-1].cached_tokens == want[-1].cached_tokens
    # The second prompt extends the first: its prefix came from the cache across the pipe.
    assert got[2][-1].cached_tokens.device > 0
    assert client.tokenize("hello") == client.tokenizer.encode("hello")
    assert client.model_name == "dummy-tiny" and client.vocab_size > 0


def test_bad_requests_are_refused_before_sending(client: EngineClient) -> None:
    async def run(request: GenerateRequest) -> None:
        await _collect(client, request)

    with pytest.raises(RequestError, match="empty"):
        asyncio.run(run(GenerateRequest(input_ids=())))
    with pytest.raises(RequestError, match="vocabulary"):
        asyncio.run(run(GenerateRequest(input_ids=(client.vocab_size,))))
    with pytest.raises(RequestError, match="context"):
        too_long = SamplingParams(max_new_tokens=client.max_context_len)
        asyncio.run(run(GenerateRequest(input_ids=(5,), sampling=too_long)))
    assert client.metrics()["engine_num_requests"] >= 0  # still answering


def test_control_calls_cross_the_pipe(client: EngineClient) -> None:
    before = client.metrics()["engine_num_requests"]
    asyncio.run(_collect(client, _requests()[0]))
    assert client.metrics()["engine_num_requests"] == before + 1
    assert client.is_idle()
    client.check_integrity()
    assert client.storage_status() == {"attached": False, "error": None}
    # The engine's own exceptions come back as themselves.
    with pytest.raises((StorageError, ValueError)):
        client.attach_storage("no-such-backend", {}, "best_effort")
    with pytest.raises(StorageError, match="no L3 storage backend is attached"):
        client.clear_storage()
    assert client.flush_cache() is True
    assert client.metrics()["device_pool_used_pages"] == 0


def test_a_caller_that_leaves_aborts_its_request(client: EngineClient) -> None:
    aborted = client.metrics()["engine_num_aborted"]

    async def leave_early() -> None:
        long = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
        stream = client.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=long))
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(leave_early())
    assert wait_until(
        lambda: client.metrics()["engine_num_aborted"] != aborted, SETTLE_S, poll_s=0.05
    ), "the engine never aborted the abandoned request"
    assert client.is_idle()


def test_a_start_failure_reports_the_engines_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    config = EngineConfig(model=ModelLoadConfig(model_path=str(missing), device="cpu"))
    with pytest.raises(EngineStartError, match="not a directory or a GGUF file"):
        EngineClient(config).start()


def test_a_dead_engine_fails_its_requests_and_says_so() -> None:
    deaths: list[int | None] = []
    client = EngineClient(CONFIG, on_death=deaths.append).start()
    try:
        assert client.pid is not None

        async def run() -> list[GenerateOutput]:
            long = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
            outputs = []
            async for out in client.generate(GenerateRequest(input_ids=PROMPTS[1], sampling=long)):
                if not outputs:
                    os.kill(client.pid, signal.SIGKILL)  # type: ignore[arg-type]
                outputs.append(out)
            return outputs

        outputs = asyncio.run(asyncio.wait_for(run(), timeout=FAILS_WITHIN_S))
        last = outputs[-1]
        assert last.finished and last.finish_reason == "abort"
        assert last.error is not None and "engine process exited" in last.error
        # Told right after the streams are failed; the assert below says if it never was.
        wait_until(lambda: deaths, SETTLE_S)
        assert deaths == [-signal.SIGKILL]
        with pytest.raises(EngineDeadError):
            client.metrics()
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(client, _requests()[0]))
    finally:
        client.shutdown()
