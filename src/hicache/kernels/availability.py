"""Whether the optional GPU libraries behind the attention and page-copy kernels can run here.

Nothing here imports Triton or FlashInfer (importing either is slow, and FlashInfer
may start compiling): presence is read from the import system, and the device from
torch. A library that is present but broken fails later, with its own error, when
a kernel is first called.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec
        return False


def triton_installed() -> bool:
    return _installed("triton")


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (same parsing as Triton's).

    ``TRITON_INTERPRET`` must be set before the kernels are defined, that is before
    their module is first imported; it then holds for the whole process.
    """
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def triton_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (default: CUDA), or None when they can.

    CUDA tensors need a CUDA device; CPU tensors need the interpreter.
    """
    if not triton_installed():
        return "Triton is not installed"
    target = torch.device("cuda" if device is None else device)
    if triton_interpreting():
        return None  # the interpreter runs on the host, whatever tensors it gets
    if target.type != "cuda":
        return f"tensors on {target} need TRITON_INTERPRET=1 (Triton compiles for CUDA devices)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def triton_available(device: torch.device | str | None = None) -> bool:
    return triton_unavailable_reason(device) is None


def flashinfer_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the FlashInfer wrapper cannot run on ``device`` (default: CUDA), or None."""
    if not _installed("flashinfer"):
        return "FlashInfer is not installed (pip install flashinfer-python)"
    target = torch.device("cuda" if device is None else device)
    if target.type != "cuda":
        return f"FlashInfer runs on CUDA devices only, not on {target}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def flashinfer_available(device: torch.device | str | None = None) -> bool:
    return flashinfer_unavailable_reason(device) is None
