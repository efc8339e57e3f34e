"""The compute settings reach the model: attention backend, packed weights, threads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hicache.config import ConfigError
from hicache.engine.config import RuntimeConfig
from hicache.engine.engine import Engine
from tests.engine_helpers import make_engine_fixture, run

__all__ = ["make_engine_fixture"]


def test_default_cpu_engine_reads_pages_in_place_with_packed_weights(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine("--model-preset", "tiny", "--dtype", "float32")
    assert engine.attention_backend == "cpu"
    assert engine.model.packed_lm_head is not None


def test_reference_settings_give_the_same_tokens(make_engine: Callable[..., Engine]) -> None:
    ids = list(range(3, 60))
    fast = make_engine("--model-preset", "tiny", "--dtype", "float32")
    reference = make_engine("--model-preset", "tiny", "--dtype", "float32",
                            "--attention-backend", "gather", "--disable-weight-prepack")
    assert reference.attention_backend == "gather"
    assert reference.model.packed_lm_head is None
    got = run(fast, ids, logits=True, max_new_tokens=12, ignore_eos=True)
    expected = run(reference, ids, logits=True, max_new_tokens=12, ignore_eos=True)
    assert got.token_ids == expected.token_ids
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_runs_a_paged_gpu_backend(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine("--device", "cuda", "--model-preset", "tiny")
    assert engine.attention_backend in ("flashinfer", "triton")


def test_runtime_config_refuses_an_unknown_backend() -> None:
    with pytest.raises(ConfigError, match="--attention-backend 'fast'"):
        RuntimeConfig(attention_backend="fast")
