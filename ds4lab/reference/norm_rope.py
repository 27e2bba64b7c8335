"""Torch (float64) references for :mod:`ds4lab_kernels.norm_rope`: per-row RMSNorm + GPT-J RoPE, the
q_norm + kv_norm + kv RoPE of the fused ``wq_a | wkv`` output and
the clamped SwiGLU.

Semantics: DeepSeek-V4 (vLLM 0.32 ``models/deepseek_v4``): RMSNorm ``x * rsqrt(mean(x^2) + eps)``
(times the gain), RoPE from :func:`ds4lab.reference.rope.apply_rope` (GPT-J pairs on the last
``rope_dim`` dims), SwiGLU from :func:`ds4lab.reference.moe.swiglu_clamp`.
"""
from __future__ import annotations

import torch

from ds4lab.reference.moe import swiglu_clamp as _swiglu
from ds4lab.reference.rope import apply_rope

__all__ = ["rmsnorm_rope", "q_kv_rmsnorm_rope", "q_kv_rmsnorm_rope_insert", "swiglu_clamp"]


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


def q_kv_rmsnorm_rope(x: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, q_dim: int, eps: float,
                      positions: torch.Tensor, cos_sin: torch.Tensor):
    """``x (T, q_dim + Dkv)`` -> ``(q (T, q_dim) float64, kv (T, Dkv) float64)``: ``q_norm`` of the
    first ``q_dim`` columns; ``kv_norm`` of the rest rounded to bf16 (vLLM's ``kv_norm`` module
    output), then RoPE at ``positions``."""
    q = rmsnorm_rope(x[:, :q_dim], q_weight, eps)
    kv = rmsnorm_rope(x[:, q_dim:], kv_weight, eps).to(torch.bfloat16)
    return q, rmsnorm_rope(kv, None, 0.0, positions, cos_sin, norm=False)


def q_kv_rmsnorm_rope_insert(x: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, q_dim: int,
                             eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_size: int = 64):
    """:func:`q_kv_rmsnorm_rope` then the fp8_ds_mla insert of its bf16 kv
    (:func:`ds4lab.reference.mla_cache.fp8_ds_mla_insert`) -> ``(q (T, q_dim) float64, a NEW cache)``
    (the input cache is not modified)."""
    from ds4lab.reference.mla_cache import fp8_ds_mla_insert
    q, kv = q_kv_rmsnorm_rope(x, q_weight, kv_weight, q_dim, eps, positions, cos_sin)
    return q, fp8_ds_mla_insert(kv.to(torch.bfloat16), slot_mapping, kv_cache, block_size)
