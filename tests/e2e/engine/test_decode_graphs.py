"""Recorded decode steps (``engine.decode_graphs``): the static-buffer step equals the normal one.

CUDA graphs need a GPU; what they replay is the static-buffer step, which runs
eagerly here (``capture=False``) with the Triton decode kernel in Triton's CPU
interpreter. ``TRITON_INTERPRET`` holds for a whole process, so the engines run in
a child (this module run with ``python -m``) that prints its findings as JSON.
The CUDA case (graphs recorded by the engine itself) is in tests/gpu.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.engine.decode_graphs import batch_buckets
from hicache.engine.engine import Engine
from tests.engine_helpers import make_engine_fixture  # noqa: F401 - a fixture

_ROOT = Path(__file__).resolve().parents[3]
_FLAGS = ("--model-preset", "tiny", "--dtype", "float32", "--attention-backend", "gather",
          "--max-running-requests", "8")


def test_buckets_end_at_the_limit_and_grow_in_steps() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 3, 4, 5)
    assert batch_buckets(8) == (1, 2, 3, 4, 6, 8)
    assert batch_buckets(40) == (1, 2, 3, 4, 6, 8, 16, 24, 32, 40)
    big = batch_buckets(160)
    assert big[-1] == 160 and list(big) == sorted(set(big))
    assert all(b - a <= 16 for a, b in itertools.pairwise(big))
    with pytest.raises(ValueError, match=">= 1"):
        batch_buckets(0)


def test_a_cpu_engine_records_no_graphs(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--model-preset", "tiny")
    assert engine.scheduler.runner.decode_graphs is None


def _child() -> dict[str, Any]:
    from hicache.engine.api import GenerateRequest, SamplingParams
    from hicache.engine.build import build_engine
    from tests.engine_helpers import engine_config, on_scheduler, run, run_many

    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(5)]
    single = list(range(40, 75))

    def serve(engine: Engine) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True)
        together = run_many(engine, [GenerateRequest(tuple(p), params) for p in prompts])
        alone = run(engine, single, logits=True, max_new_tokens=9, ignore_eos=True)
        engine.check_integrity()
        return {
            "together": [r.token_ids for r in together],
            "alone": alone.token_ids,
            "logits": torch.stack(alone.logits),
        }

    reference = build_engine(engine_config(*_FLAGS))
    try:
        expected = serve(reference)
    finally:
        reference.shutdown()
    recorded = build_engine(engine_config(*_FLAGS))
    try:
        runner = recorded.scheduler.runner
        problem = on_scheduler(recorded, lambda: runner.record_decode_graphs(8, capture=False))
        graphs = runner.decode_graphs
        assert graphs is not None
        got = serve(recorded)  # check_integrity: the reserved page is no leak
        replays = dict(graphs.replays)
    finally:
        recorded.shutdown()
    return {
        "problem": problem,
        "buckets": list(graphs.buckets),
        "replays": {str(size): count for size, count in replays.items()},
        "together_equal": got["together"] == expected["together"],
        "alone_equal": got["alone"] == expected["alone"],
        "tokens": len(got["alone"]) + sum(len(t) for t in got["together"]),
        "max_logit_diff": float((got["logits"] - expected["logits"]).abs().max()),
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, "-m", "tests.e2e.engine.test_decode_graphs"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stdout}\n{child.stderr}"
    found: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return found


def test_recorded_decode_steps_give_the_same_tokens_and_logits(
    interpreted: dict[str, Any],
) -> None:
    found = interpreted
    assert found["problem"] is None
    assert found["buckets"] == [1, 2, 3, 4, 6, 8]
    assert found["together_equal"] and found["alone_equal"], found
    assert found["tokens"] == 5 * 7 + 9
    assert found["max_logit_diff"] < 1e-4, found


def test_recorded_steps_ran_padded_and_unpadded(interpreted: dict[str, Any]) -> None:
    replays = {int(size): count for size, count in interpreted["replays"].items()}
    # Five requests decoding together take the bucket of 6 (one padding row) while
    # all five run; the lone request decodes in the bucket of 1.
    assert replays.get(6, 0) >= 1, replays
    assert replays.get(1, 0) >= 8, replays
    assert sum(replays.values()) >= 6 + 8, replays


if __name__ == "__main__":
    print(json.dumps(_child()))
