"""The Triton copy kernel run by Triton's CPU interpreter, against the reference.

``TRITON_INTERPRET=1`` must be set before a kernel is defined and applies to the
whole process (it would also turn real GPU launches into interpreted ones), so
the cases run in one child process: this module run with ``python -m``. Each
parametrized test then checks its own case's outcome.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from hicache.config import MemLayout
from hicache.memory.geometry import KVGeometry
from tests.transfer_reference import check_round_trip

pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[2]
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (layout, page size, dtype, kv heads, layer, token-major launch); kv heads 3 x
# head dim 8 = rows of 24 elements: 6 eight-byte units in fp16, not a power of
# two, so masked. 3 layers = 6 (layer, k|v) rows per token: masked when token-major.
# kv heads 0 stands for an MLA geometry: one plane (a latent of 24) per layer, so 3
# (layer, plane) rows per token.
MLA_HEADS = 0
Case = tuple[MemLayout, int, str, int, "int | None", bool]
_CASES: list[Case] = [
    (layout, page_size, dtype, heads, layer, token_major)
    for layout in MemLayout
    for page_size in (1, 16, 64)
    for dtype, heads in (("fp32", 2), ("bf16", 2), ("fp16", 3), ("bf16", MLA_HEADS))
    for layer in (None, 1)
    for token_major in (False, True)
    # Token-major runs one interpreted program per token: page 64 would add a
    # minute while testing nothing page 16 does not.
    if not (token_major and page_size == 64)
]


def _case_id(case: Case) -> str:
    layout, page_size, dtype, heads, layer, token_major = case
    where = "all" if layer is None else f"layer{layer}"
    order = "token" if token_major else "page"
    kv = "mla" if heads == MLA_HEADS else f"h{heads}"
    return f"{layout.value}-p{page_size}-{dtype}-{kv}-{where}-{order}"


def _geometry(dtype: str, heads: int) -> KVGeometry:
    if heads == MLA_HEADS:
        return KVGeometry.mla(num_layers=3, latent_dim=24, dtype=_DTYPES[dtype])
    return KVGeometry(num_layers=3, num_kv_heads=heads, head_dim=8, dtype=_DTYPES[dtype])


def _run_case(case: Case) -> str | None:
    from hicache.transfer.kernel import KernelBackend

    layout, page_size, dtype, heads, layer, token_major = case
    geometry = _geometry(dtype, heads)
    try:
        check_round_trip(
            geometry, layout, page_size, layer,
            lambda host, device: KernelBackend(host, device, token_major=token_major),
            seed=page_size, host_pages=12, device_pages=10, moved=6,
        )
    except Exception:
        return traceback.format_exc()
    return None


_WARM_UP = "warm-up"


def _run_warm_up() -> str | None:
    """Building a backend over filled pools compiles its variants and changes no byte."""
    from hicache.transfer.kernel import KernelBackend
    from tests.transfer_reference import bits, fill_random, make_pools

    try:
        geometries = (
            KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
            KVGeometry.mla(num_layers=3, latent_dim=24, dtype=torch.bfloat16),
        )
        for geometry, layout in itertools.product(geometries, MemLayout):
            host, dev = make_pools(geometry, layout, 16, 6, 5, "cpu")
            fill_random(host.flat, 1)
            fill_random(dev.flat, 2)
            before = bits(host.flat).clone(), bits(dev.flat).clone()
            KernelBackend(host, dev)
            assert torch.equal(bits(host.flat), before[0]), f"{layout}: warm-up wrote the host"
            assert torch.equal(bits(dev.flat), before[1]), f"{layout}: warm-up wrote the device"
    except Exception:
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, "-m", "tests.e2e.test_kernel_interpreter"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stdout}\n{child.stderr}"
    results: dict[str, str | None] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def test_building_the_backend_compiles_without_touching_a_page(
    interpreted: dict[str, str | None],
) -> None:
    assert interpreted[_WARM_UP] is None, interpreted[_WARM_UP]


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_kernel_matches_reference_in_interpreter(
    interpreted: dict[str, str | None], case: Case
) -> None:
    outcome = interpreted[_case_id(case)]
    assert outcome is None, outcome


if __name__ == "__main__":
    from hicache.transfer.kernel import triton_interpreting

    if not triton_interpreting():
        sys.exit("run with TRITON_INTERPRET=1")
    outcomes = {_case_id(case): _run_case(case) for case in _CASES}
    outcomes[_WARM_UP] = _run_warm_up()
    print(json.dumps(outcomes))
