"""Hints across the engine process's pipe (``EngineClient``): ``apply_hints`` and
``hint_status`` run in the other process and their outcomes come back whole, and a
request's own hints come back in its final output."""

from __future__ import annotations

import asyncio

from hicache.engine.api import (
    GenerateOutput,
    GenerateRequest,
    Hint,
    HintKind,
    HintOutcome,
    HintOutcomeKind,
    SamplingParams,
)
from hicache.engine.engine_client import EngineClient
from hicache.server.engine_args import engine_config_from_args
from tests.server_fixtures import parse_test_args

PAGE = 16
PROMPT = tuple(range(2, 2 + 5 * PAGE + 3))


async def run(client: EngineClient, hints: tuple[Hint, ...]) -> list[GenerateOutput]:
    request = GenerateRequest(
        input_ids=PROMPT, rid="r", hints=hints,
        sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    )
    return [out async for out in client.generate(request)]


def test_hints_cross_the_engine_process_pipe() -> None:
    config = engine_config_from_args(parse_test_args([
        "--page-size", str(PAGE), "--enable-hierarchical-cache",
        "--hicache-retain-ttl-s", "120",
    ]))
    client = EngineClient(config).start()
    try:
        outputs = asyncio.run(run(client, (Hint(HintKind.RETAIN),)))
        assert all(out.hints is None for out in outputs[:-1])
        assert outputs[-1].hints == [HintOutcome(0, HintKind.RETAIN, HintOutcomeKind.ACCEPTED,
                                                 tokens=5 * PAGE)]
        results = client.apply_hints([
            Hint(HintKind.PIN, PROMPT, tenant="t"), Hint(HintKind.UNPIN, (1,) * PAGE),
        ])
        assert [r.as_dict() for r in results] == [
            {"index": 0, "kind": "pin", "outcome": "accepted", "tokens": 5 * PAGE,
             "clipped_tokens": 0, "reason": ""},
            {"index": 1, "kind": "unpin", "outcome": "rejected", "tokens": 0,
             "clipped_tokens": 0, "reason": "not pinned"},
        ]
        status = client.hint_status()
        assert status["pinned_pages"] == 5 and status["retained_pages"] >= 5
        assert status["pinned_pages_by_tenant"] == {"t": 5}
        assert status["outcomes"] == {
            "retain/accepted": 1, "pin/accepted": 1, "unpin/rejected": 1,
        }
    finally:
        client.shutdown()
