"""The Triton attention backend inside the model, run by Triton's CPU interpreter.

The kernels' own cases are in test_paged_attention_interpreter.py; this checks the
backend's wiring (page table rows, lengths, qo_indptr, decode vs extend dispatch)
through whole forward steps of a GQA model: the same logits as the reference
backend for a mixed step (cold prefill, prefill over a cached prefix, decodes) and
a decode-only step. ``TRITON_INTERPRET`` holds for a whole process: the model runs
in a child (this module run with ``python -m``), which prints its findings as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[3]


def _child() -> dict[str, object]:
    import torch

    from hicache.attention.backend import make_attention_backend
    from tests.model_scenarios import dummy_model, mixed_batch_vs_alone, small_qwen3_style

    model = dummy_model(small_qwen3_style())
    results: dict[str, object] = {}
    for name, decodes, prompts in (("mixed", [5, 2, 12], (6, 4)), ("decode", [7, 3], (1, 1))):
        model.attention_backend = make_attention_backend("gather", "cpu")
        reference, _ = mixed_batch_vs_alone(model, prompts, decodes)
        model.attention_backend = make_attention_backend("triton", "cpu")
        got, alone = mixed_batch_vs_alone(model, prompts, decodes)
        results[name] = {
            "backend": model.attention_backend.name,
            "max_diff": float((got - reference).abs().max()),
            "alone_diff": float((alone - reference).abs().max()),
            "same_argmax": bool(torch.equal(got.argmax(-1), reference.argmax(-1))),
        }
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, "-m", "tests.e2e.model.test_triton_backend_interpreter"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stdout}\n{child.stderr}"
    results: dict[str, dict[str, object]] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("step", ["mixed", "decode"])
def test_triton_backend_equals_reference_in_the_model(
    interpreted: dict[str, dict[str, object]], step: str
) -> None:
    found = interpreted[step]
    assert found["backend"] == "triton"
    assert float(found["max_diff"]) < 1e-4, found  # type: ignore[arg-type]
    assert float(found["alone_diff"]) < 1e-4, found  # type: ignore[arg-type]
    assert found["same_argmax"], found


if __name__ == "__main__":
    print(json.dumps(_child()))
