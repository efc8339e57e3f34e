"""The Triton attention kernels compile for NVIDIA GPUs (sm_90, sm_80), without a GPU.

The interpreter runs a kernel's Python, not Triton's compiler: a construct the
interpreter accepts may still fail to lower to GPU code. Triton compiles ahead of
time for an explicit target with no device present (its wheel ships ptxas), so
each kernel variant the launchers pick for a representative shape is compiled
to a cubin here, specialized as a launch would be (aligned pointers, strides
multiples of 16). Runs in a child process: the parent may be interpreting.
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

# (name, arch, dtype, head_dim, page_size, group): bf16 GQA 4:1 D=128 (Llama-like);
# fp32 (exact products), GQA 3:1 and page 1 (as SmolLM2), a non-power-of-two D.
# Two variants only: each costs seconds of compiling.
_VARIANTS = [
    ("sm90-bf16-d128-p16-g4", 90, "bf16", 128, 16, 4),
    ("sm80-fp32-d96-p1-g3", 80, "fp32", 96, 1, 3),
]
# Shared memory of the smallest NVIDIA GPUs Triton targets with these kernels (sm_86/89).
_SHARED_LIMIT = 99 * 1024


def _compile_all() -> dict[str, dict[str, int]]:
    """Compile every variant; kernel name -> shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hicache.attention import triton as launcher
    from hicache.attention import triton_jit as jit

    elem = {"fp16": 2, "bf16": 2, "fp32": 4}
    results: dict[str, dict[str, int]] = {}
    for name, arch, dtype, head_dim, page_size, group in _VARIANTS:
        block_n = launcher._block_n(head_dim, elem[dtype])
        block_d = launcher._block_d(head_dim)
        mode = jit.DOT_IEEE if dtype == "fp32" else jit.DOT_NATIVE
        common = {"PAGE_SIZE": page_size, "GROUP": group, "HEAD_DIM": head_dim,
                  "BLOCK_N": block_n, "BLOCK_D": block_d, "DOT_MODE": mode}
        kernels = [
            ("decode", jit.decode_kernel,
             {**common, "BLOCK_H": max(16, group), "DIRECT": False}, 4),
            ("decode_direct", jit.decode_kernel,
             {**common, "BLOCK_H": max(16, group), "DIRECT": True}, 4),
            ("reduce", jit.decode_reduce_kernel,
             {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_S": 16}, 4),
            ("extend", jit.extend_kernel, {**common, "BLOCK_M": 64}, 4 if head_dim <= 64 else 8),
        ]
        outcome: dict[str, int] = {}
        for kernel_name, fn, constexprs, num_warps in kernels:
            signature, attrs = {}, {}
            for index, arg in enumerate(fn.arg_names):
                if arg in constexprs:
                    signature[arg] = "constexpr"
                elif arg in ("part_out", "part_lse"):
                    signature[arg] = "*fp32"
                elif arg in ("page_table", "seq_lens", "qo_indptr"):
                    signature[arg] = "*i32"
                elif arg in ("q", "k_cache", "v_cache", "out"):
                    signature[arg] = f"*{dtype}"
                elif arg == "scale_log2":
                    signature[arg] = "fp32"
                else:
                    signature[arg] = "i32"
                if signature[arg].startswith("*") or arg.startswith("stride"):
                    attrs[(index,)] = [["tt.divisibility", 16]]
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": num_warps, "num_stages": 2},
            )
            assert compiled.asm.get("cubin"), f"{name} {kernel_name}: no cubin"
            outcome[kernel_name] = int(compiled.metadata.shared)
        results[name] = outcome
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    child = subprocess.run(
        [sys.executable, "-m", "tests.e2e.model.test_paged_attention_compile"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    if "no NVIDIA backend" in child.stdout:
        pytest.skip("this Triton has no NVIDIA backend")
    assert child.returncode == 0, f"compiling failed:\n{child.stdout}\n{child.stderr}"
    results: dict[str, dict[str, int]] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("variant", [v[0] for v in _VARIANTS])
def test_kernels_compile_for_the_gpu(compiled: dict[str, dict[str, int]], variant: str) -> None:
    shared = compiled[variant]
    assert set(shared) == {"decode", "decode_direct", "reduce", "extend"}
    for kernel, size in shared.items():
        assert size <= _SHARED_LIMIT, f"{kernel} needs {size} bytes of shared memory"


if __name__ == "__main__":
    from triton.backends import backends

    if "nvidia" not in backends:
        print("no NVIDIA backend")
        sys.exit(0)
    print(json.dumps(_compile_all()))
