"""A decoder layer's work around attention, as plain functions of tensors.

Everything in a layer but attention itself is dense per-token math: the norm,
the q/k/v projection, qk-norm and RoPE before; the output projection, residual,
norm and SwiGLU after. Written as functions of the weights (not methods), one
compiled function serves every layer: ``torch.compile`` fuses the elementwise
ops between the GEMMs once, for all layers and any number of tokens, instead of
once per layer module. Weights may be oneDNN-packed copies (``linear.prepack``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hicache.kernels import cpu_layer_ops
from hicache.model.linear import linear
from hicache.model.norm import rms_norm
from hicache.model.rotary import apply_rotary


def pre_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> q [T, heads, D], k and v [T, kv_heads, D] (q and k rotated)."""
    num_tokens = x.shape[0]
    qkv = linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    # Rows of qkv are [q heads | k heads | v heads]: viewed as heads, q and k are
    # neighbours and RoPE treats every head alike.
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, -1)
    q, k, v = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    if q_norm_weight is not None and k_norm_weight is not None:
        # Per head, before RoPE (Qwen3).
        q = apply_rotary(rms_norm(q, q_norm_weight, eps), cos, sin)
        k = apply_rotary(rms_norm(k, k_norm_weight, eps), cos, sin)
    else:
        # One rotation for q and k together: half the kernel launches of two, which
        # is what a decode step of small tensors pays for. Same values either way.
        qk = apply_rotary(heads[:, : num_heads + num_kv_heads], cos, sin)
        q, k = qk.split((num_heads, num_kv_heads), dim=1)
    return q, k, v


def post_attention(
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Attention output [T, heads, D] and the layer's input [T, hidden] -> its output."""
    h = attention_output(attn, residual, o_weight, o_bias)
    return feed_forward(h, h, norm_weight, gate_up_weight, down_weight, eps)


# Under tensor parallelism ``post_attention`` is cut at its two sums over the ranks
# (after the row-parallel o and down projections): each half returns the rank's
# partial product, plus the residual (and bias) only where given, on one rank, so
# that the sum over ranks adds them once.


def attention_output(
    attn: torch.Tensor,
    residual: torch.Tensor | None,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
) -> torch.Tensor:
    """attn [T, heads, D] -> o_proj(attn) [T, hidden] (+ o_bias) (+ residual)."""
    h = linear(attn.reshape(attn.shape[0], -1), o_weight, o_bias)
    return h if residual is None else h.add_(residual)


def feed_forward(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """h [T, hidden] -> SwiGLU(norm(h)) [T, hidden] (+ residual)."""
    out = linear(swiglu(linear(rms_norm(h, norm_weight, eps), gate_up_weight)), down_weight)
    return out if residual is None else out.add_(residual)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (the gate and up projections side by side) -> silu(gate) * up [T, I]."""
    fused = cpu_layer_ops.silu_mul(gate_up)  # on the CPU: one pass, no gate/up copies
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
