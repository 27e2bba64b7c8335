"""Torch (float64) references for :mod:`ds4lab_kernels.norm_rope`: per-row RMSNorm + GPT-J RoPE and
the clamped SwiGLU.

Semantics: DeepSeek-V4 (vLLM 0.32 ``models/deepseek_v4``): RMSNorm ``x * rsqrt(mean(x^2) + eps)``
(times the gain), RoPE from :func:`ds4lab.reference.rope.apply_rope` (GPT-J pairs on the last
``rope_dim`` dims), SwiGLU from :func:`ds4lab.reference.moe.swiglu_clamp`.
"""
from __future__ import annotations

import torch

from ds4lab.reference.moe import swiglu_clamp as _swiglu
from ds4lab.reference.rope import apply_rope

__all__ = ["rmsnorm_rope", "swiglu_clamp"]


def rmsnorm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                 positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                 norm: bool = True) -> torch.Tensor:
    """``x (T, D)`` or ``(T, H, D)`` -> float64 of the same shape: per-row RMSNorm over ``D``
    (``norm``; times ``weight (D,)`` if given), then RoPE at ``positions (T,)`` if given."""
    y = x.to(torch.float64)
    if norm:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.to(torch.float64)
    if positions is not None:
        y = apply_rope(y, positions, cos_sin)
    return y


def swiglu_clamp(gu: torch.Tensor, limit: float) -> torch.Tensor:
    """``gu (T, 2I)`` -> float64 ``(T, I)``: ``silu(min(g, limit)) * clamp(u, -limit, limit)``."""
    g = gu.to(torch.float64)
    I = g.shape[1] // 2
    return _swiglu(g[:, :I], g[:, I:], limit)
