"""Engines over the tiny dummy model for tests: build, run requests, always shut down."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from hicache.engine.api import GenerateOutput, GenerateRequest, SamplingParams
from hicache.engine.build import build_engine
from hicache.engine.config import EngineConfig
from hicache.engine.engine import Engine
from hicache.engine.threads import available_cores
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from tests.waiting import wait_until


def engine_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(["--device", "cpu", *flags])


def engine_config(*flags: str) -> EngineConfig:
    """The EngineConfig of a CPU engine with these command-line flags."""
    return engine_config_from_args(engine_args(*flags))


@dataclass
class Run:
    """Everything one request streamed back, plus the logits of its tokens."""

    outputs: list[GenerateOutput]
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def text(self) -> str:
        return "".join(out.text for out in self.outputs)

    @property
    def last(self) -> GenerateOutput:
        return self.outputs[-1]


async def collect(engine: Engine, request: GenerateRequest) -> Run:
    return Run([out async for out in engine.generate(request)])


def run(engine: Engine, ids: list[int], logits: bool = False, **sampling: object) -> Run:
    """One request to completion; with ``logits`` also the logits of every sampled token."""
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 8, **sampling})  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    if logits:
        engine.scheduler.postprocess.logits_observer = lambda rid, row: seen.append(row)
    try:
        result = asyncio.run(collect(engine, GenerateRequest(tuple(ids), params)))
    finally:
        engine.scheduler.postprocess.logits_observer = None
    result.logits = seen
    return result


def run_many(engine: Engine, requests: list[GenerateRequest]) -> list[Run]:
    async def all_of() -> list[Run]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    return asyncio.run(all_of())


def wait_idle(engine: Engine, timeout_s: float = 60.0) -> None:
    """Until nothing runs or waits (an aborted request finishes on the scheduler's time);
    ``timeout_s`` guards against a hang, far above what a busy machine needs."""
    assert wait_until(engine.is_idle, timeout_s), "requests are still running"


def on_scheduler(engine: Engine, fn: Callable[[], object]) -> object:
    return engine.scheduler.call(fn).result(timeout=60)


@pytest.fixture(name="make_engine")
def make_engine_fixture() -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(*flags: str, governed: bool = False) -> Engine:
        """An engine with these flags. Its torch thread count is fixed (every core) unless
        the flags set one or ``governed``: the thread governor follows the machine's load,
        and a reduction over another number of threads rounds differently, so runs that
        must agree bit for bit would disagree on a loaded machine."""
        if not governed and "--num-threads" not in flags:
            flags = (*flags, "--num-threads", str(available_cores()))
        engine = build_engine(engine_config(*flags))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
