"""A warm across the engine process's pipe (``EngineClient``): the server's warm loop
(``server/warm.py``) drives ``warm_start``/``warm_step`` in another process, the prefix
lands in that engine's host tier, and a request for it is a host hit with the answer an
in-process engine computed cold."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.config import EngineConfig
from hicache.engine.engine_client import EngineClient
from hicache.server.engine_args import engine_config_from_args
from hicache.server.warm import warm
from tests.server_fixtures import parse_test_args
from tests.waiting import wait_until

PAGE = 16
PROMPT = tuple(range(2, 2 + 5 * PAGE + 3))


def config(l3_dir: Path) -> EngineConfig:
    extra = json.dumps({"path": str(l3_dir), "prefetch_threshold": PAGE})
    return engine_config_from_args(parse_test_args([
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra,
    ]))


async def run(engine: object) -> list[GenerateOutput]:
    request = GenerateRequest(
        input_ids=PROMPT, rid="r",
        sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    )
    return [out async for out in engine.generate(request)]  # type: ignore[attr-defined]


def test_a_warm_through_the_engine_process_gives_a_host_hit(tmp_path: Path) -> None:
    local = build_engine(config(tmp_path))
    try:
        cold = asyncio.run(run(local))

        def stored() -> bool:
            return bool(local.storage_status()["metrics"]["backup_pages_stored"] >= 5)

        assert wait_until(stored), "the pages never reached L3"
    finally:
        local.shutdown()

    client = EngineClient(config(tmp_path)).start()
    try:
        results = asyncio.run(warm(client, [list(PROMPT)], 0.5, 30.0))
        assert results == [{"index": 0, "outcome": "warmed", "tokens": 5 * PAGE, "reason": ""}]
        assert client.is_idle()

        hit = asyncio.run(run(client))
    finally:
        client.shutdown()
    assert hit[-1].cached_tokens.host == 5 * PAGE
    assert hit[-1].cached_tokens.storage == 0
    assert sum((o.token_ids for o in hit), ()) == sum((o.token_ids for o in cold), ())
