"""``--tp-size 2`` through the engine's processes (EngineClient: rank 0 the engine process,
rank 1 a follower, gloo over loopback) gives the single-rank engine's greedy and seeded
outputs (float32), cold and from L1, L2 and L3 (a file store, read back after a flush),
on a transformers-made checkpoint whose ranks hold different numbers of KV heads (2 and
1: pools of different page bytes, one page count), and on SmolLM2 when installed.

Tokens and the reuse counts must be equal. Logprobs (of each output token and the top
few) agree within float32 noise, not bit for bit: the row-parallel layers sum the ranks'
partial products in another order than the single rank's matmul does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from hicache.config import CacheConfig
from hicache.distributed.group import DEFAULT_TIMEOUT_S
from hicache.engine.api import (
    CachedTokens,
    GenerateOutput,
    GenerateRequest,
    GrammarSpec,
    LogprobParams,
    SamplingParams,
)
from hicache.engine.build import build_engine
from hicache.engine.config import EngineConfig, ModelLoadConfig, ParallelConfig, SchedulingConfig
from hicache.engine.engine_client import EngineClient, EngineStartError
from hicache.model.default_model import DefaultModelMissingError, default_model_path
from hicache.storage.config import PrefetchPolicy, StorageConfig
from tests import tp_engine_faults
from tests.hf_checkpoints import write_checkpoint
from tests.waiting import wait_until

# SmolLM2's head layout at test size: 3 KV heads of 2 query heads, split 2:1 over 2 ranks.
UNEVEN = LlamaConfig(
    vocab_size=321, hidden_size=48, intermediate_size=97, num_hidden_layers=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, num_attention_heads=6,
    num_key_value_heads=3, tie_word_embeddings=False,
)

Outcome = tuple[tuple[int, ...], str | None, CachedTokens]  # tokens, finish reason, cached
# Per output token: its logprob, then the top TOP_N logprobs (most likely first).
Logprobs = tuple[tuple[float, ...], ...]
TOP_N = 5
# Float32 noise: measured differences reach 3e-5 on SmolLM2 (2e-6 on the small model).
LOGPROB_TOLERANCE = 2e-4
# Spawning the ranks and building them: a hang guard, far above a start on a busy machine.
START_TIMEOUT_S = DEFAULT_TIMEOUT_S
# A rank that fails ends the group at once; without that, the others would wait in their
# next collective for the group's timeout (DEFAULT_TIMEOUT_S). The bound sits between.
ENDS_WITHIN_S = DEFAULT_TIMEOUT_S / 4
# Waits for what follows in the background: guards against a hang, not bounds.
SETTLE_S = 60.0


def _config(model_path: str, tp_size: int, l3_path: Path) -> EngineConfig:
    # wait_complete: what L3 gives a request does not depend on timing.
    storage = StorageConfig(
        backend="file", prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=4,
        backend_extra={"path": str(l3_path)},
    )
    return EngineConfig(
        model=ModelLoadConfig(model_path=model_path, dtype="float32", device="cpu"),
        scheduling=SchedulingConfig(max_total_tokens=512),
        cache=CacheConfig(page_size=4, enable_hierarchical_cache=True),
        storage=storage,
        parallel=ParallelConfig(tp_size=tp_size),
    )


def _request(rid: str, ids: list[int], sampled: bool = False, n: int = 8) -> GenerateRequest:
    sampling = (SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.9, seed=5,
                               ignore_eos=True) if sampled
                else SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    logprobs = None if sampled else LogprobParams(top_n=TOP_N)
    return GenerateRequest(input_ids=tuple(ids), sampling=sampling, rid=rid, logprobs=logprobs)


async def _outcome(engine: Any, request: GenerateRequest, logprobs: dict[str, Logprobs]) -> Outcome:
    outputs: list[GenerateOutput] = [out async for out in engine.generate(request)]
    last = outputs[-1]
    assert last.error is None, last.error
    if request.logprobs is not None:
        logprobs[request.rid or ""] = tuple(
            (float(lp.logprob or 0.0), *(value for _, value in lp.top))
            for o in outputs for lp in o.output_logprobs
        )
    return sum((o.token_ids for o in outputs), ()), last.finish_reason, last.cached_tokens


# Outcomes, greedy requests' logprobs, and the engine's metrics at the end.
Run = tuple[dict[str, Outcome], dict[str, Logprobs], dict[str, float]]


def _scenario(engine: Any, vocab: int) -> Run:
    """Cold, a repeat from L1, a repeat from L2 (device cache evicted), a batch of
    requests at once, and a repeat after a flush (from L3, which keeps the pages)."""
    base = [(7 * i + 3) % vocab for i in range(29)]
    other = [(11 * i + 5) % vocab for i in range(21)]
    # Its own prompt: one shared with "other", sent at the same time, would hit the pages
    # "other" inserts or not depending on which step each arrives in (a race, not TP).
    third = [(13 * i + 7) % vocab for i in range(19)]
    fourth = [(17 * i + 2) % vocab for i in range(9)]  # the constrained request's, likewise
    got: dict[str, Outcome] = {}
    logprobs: dict[str, Logprobs] = {}

    async def one(rid: str, request: GenerateRequest) -> None:
        got[rid] = await _outcome(engine, request, logprobs)

    async def together(requests: list[GenerateRequest]) -> None:
        await asyncio.gather(*(one(r.rid or "", r) for r in requests))

    asyncio.run(one("cold", _request("cold", base)))
    asyncio.run(one("l1", _request("l1", base)))
    assert engine.evict_device_cache() > 0
    asyncio.run(one("l2", _request("l2", base)))
    asyncio.run(together([
        _request("extends", [*base, 1, 2, 3]), _request("other", other),
        _request("sampled", third, sampled=True),
        # Every rank masks with its own matcher of the same grammar: the ranks agree.
        dataclasses.replace(_request("constrained", fourth, sampled=True, n=12), sampling=(
            SamplingParams(max_new_tokens=12, temperature=0.9, seed=3,
                           grammar=GrammarSpec("regex", "[a-d]{2,5}x")))),
    ]))
    tokens, reason, _ = got["constrained"]  # ended by the model's eos once "x" matched
    assert reason == "stop" and tokens[-1] in engine.tokenizer.eos_token_ids
    assert re.fullmatch("[a-d]{2,5}x", engine.tokenizer.decode(tokens[:-1]))
    engine.check_integrity()
    assert engine.flush_cache()
    asyncio.run(one("l3", _request("l3", base)))
    return got, logprobs, engine.metrics()


def _alone(model_path: str, vocab: int, l3_path: Path) -> Run:
    engine = build_engine(_config(model_path, 1, l3_path))
    try:
        return _scenario(engine, vocab)
    finally:
        engine.shutdown()


def _tp2(model_path: str, vocab: int, l3_path: Path) -> Run:
    client = EngineClient(_config(model_path, 2, l3_path),
                          start_timeout_s=START_TIMEOUT_S).start()
    try:
        return _scenario(client, vocab)
    finally:
        client.shutdown()


def _assert_same(alone_run: Run, tp2_run: Run) -> None:
    (alone, alone_logprobs, alone_metrics), (tp2, tp2_logprobs, tp2_metrics) = alone_run, tp2_run
    assert tp2 == alone
    assert alone["cold"][2] == CachedTokens()
    assert alone["l1"][2].device > 0 and alone["l2"][2].host > 0
    assert alone["extends"][2].device > 0
    # After the flush L1 and L2 hold nothing: the prefix comes back from L3 alone.
    l3 = alone["l3"][2]
    assert l3.storage > 0 and l3.device == 0 and l3.host == 0
    assert all(len(tokens) == 8 for rid, (tokens, _, _) in alone.items() if rid != "constrained")
    greedy = {rid for rid in alone if rid not in ("sampled", "constrained")}
    assert set(alone_logprobs) == set(tp2_logprobs) == greedy
    for rid in greedy:
        expected, got = alone_logprobs[rid], tp2_logprobs[rid]
        assert len(got) == len(expected) == 8
        assert all(len(row) == 1 + TOP_N for row in expected)
        for row_expected, row_got in zip(expected, got, strict=True):
            assert row_got == pytest.approx(row_expected, abs=LOGPROB_TOLERANCE), rid
    # L3 counters are summed over the ranks' stores: each rank looked up and read its own
    # shard of the same pages the single rank did.
    for key in ("storage_prefetch_queries", "storage_prefetch_pages_found",
                "storage_prefetch_pages_loaded"):
        assert alone_metrics[key] > 0
        assert tp2_metrics[key] == 2 * alone_metrics[key], key
    # The cost model is rank 0's (the ranks step together), fed under TP as alone: its
    # prefill steps, its loads, and its store's reads (the store is named by backend).
    for numbers in (alone_metrics, tp2_metrics):
        assert numbers["cost_prefill_samples"] > 0
        assert numbers["cost_l2_load_samples"] > 0
        assert numbers["cost_l3_read_samples_backend_file"] >= 1


@pytest.fixture(scope="module")
def uneven_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("llama-uneven")
    write_checkpoint(UNEVEN, path)
    yield path


def test_tp2_engine_equals_one_rank(uneven_checkpoint: Path, tmp_path: Path) -> None:
    vocab, path = UNEVEN.vocab_size, str(uneven_checkpoint)
    _assert_same(
        _alone(path, vocab, tmp_path / "l3-alone"), _tp2(path, vocab, tmp_path / "l3-tp2")
    )


@pytest.mark.slow  # about 35 s on two cores: both engines load and run the real model
def test_smollm2_tp2_engine_equals_one_rank(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    try:
        default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    converted = request.getfixturevalue("smollm2")
    # The ranks (child processes) find the float32 conversion in this cache dir.
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(Path(converted.path).parent.parent))
    path = str(converted.path)
    _assert_same(
        _alone(path, 49152, tmp_path / "l3-alone"), _tp2(path, 49152, tmp_path / "l3-tp2")
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_an_exception_in_a_tick_on_any_rank_ends_the_engine_within_seconds(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank whose tick raised ends its process (its state may differ from the
    others'); the group, and with it every request in flight, ends too, never hangs."""
    config = EngineConfig(
        model=ModelLoadConfig(preset="tiny", device="cpu"),
        scheduling=SchedulingConfig(max_total_tokens=512),
        parallel=ParallelConfig(tp_size=2),
    )
    on_built = None
    if rank == 0:
        on_built = tp_engine_faults.raise_in_tick
    else:
        monkeypatch.setattr(
            "hicache.engine.engine_client.run_follower_process",
            tp_engine_faults.raising_follower,
        )
    deaths: list[int | None] = []
    client = EngineClient(config, on_built=on_built, on_death=deaths.append,
                          start_timeout_s=START_TIMEOUT_S).start()
    try:
        async def run() -> GenerateOutput:
            outputs = [out async for out in client.generate(_request("r", [3, 4, 5, 6, 7]))]
            return outputs[-1]

        last = asyncio.run(asyncio.wait_for(run(), timeout=ENDS_WITHIN_S))
        assert last.finished and last.finish_reason == "abort" and last.token_ids == ()
        # The cause, not "shutting down": the rank that raised, or the follower's exit
        # (code 3: its group failed) when rank 0 hears of it first; or, when rank 0's
        # collective failed first, rank 0's failure naming the lost peer.
        assert last.error is not None
        if rank == 0:
            assert f"tensor-parallel rank 0 failed (RuntimeError: {tp_engine_faults.FAULT})" in (
                last.error
            )
        else:
            assert "tensor-parallel rank 1 exited (exit code 3)" in last.error or (
                "tensor-parallel rank 0 failed" in last.error
                and "Connection closed by peer" in last.error
            ), last.error
        assert wait_until(lambda: deaths, SETTLE_S), "on_death was not called"
        for process in [client._process, *client._followers]:  # every rank ends
            process.join(SETTLE_S)
            assert not process.is_alive()
    finally:
        client.shutdown()


def test_a_model_that_does_not_split_fails_to_start_with_the_reason() -> None:
    config = EngineConfig(
        model=ModelLoadConfig(preset="tiny", device="cpu"),  # 2 KV heads: not over 3 ranks
        scheduling=SchedulingConfig(max_total_tokens=512),
        parallel=ParallelConfig(tp_size=3),
    )
    client = EngineClient(config, start_timeout_s=START_TIMEOUT_S)
    with pytest.raises(EngineStartError, match="tp size 3 does not fit 2 KV heads"):
        client.start()
    assert not any(p.is_alive() for p in [client._process, *client._followers])
