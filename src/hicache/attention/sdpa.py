"""Torch's scaled-dot-product attention as the backends share it: causal over fresh K/V.

A cold prompt (nothing of it in the pool yet) attends only to its own new K/V, so
every backend runs it the same way: one causal SDPA call, the flash kernel on GPU,
exactly as a plain prefill. Grouped KV heads go to SDPA's ``enable_gqa`` (torch 2.5
and later) rather than being repeated once per query head.

This module imports torch alone (not ``torch.nn.attention``, which pulls in
torch's compiler and, through it, Triton), so the kernel backends stay light to import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# enable_gqa appeared in torch 2.5; older versions get K/V heads repeated instead.
SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # [n, heads, D] -> [1, heads, n, D]: the layout SDPA's fused kernels take.
    out = _sdpa_gqa(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
    )
    return out[0].transpose(0, 1)  # [n, heads, D]


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """SDPA with q [1, heads, n, D] over k, v [1, kv_heads, n, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
