"""Torch reference of :func:`ds4lab_kernels.norm_rope.q_norm_rope_indexer_q`: a C4A layer's two q
preparations after the fused ``wq_b | indexer wq_b`` GEMM, composed from their own references.

Semantics: vLLM 0.32 ``models/deepseek_v4``: the attention q's weight-free per-head RMSNorm + GPT-J
RoPE (:func:`ds4lab.reference.norm_rope.rmsnorm_rope`, float64) and the indexer q's RoPE + bf16 + pow2
FP8 quant with the scale folded into the head weights (:func:`ds4lab.reference.indexer.indexer_q_rope_quant`,
float32 RoPE: the glue's arithmetic, which the kernel matches bit for bit).
"""
from __future__ import annotations

import torch

from ds4lab.reference.indexer import indexer_q_rope_quant
from ds4lab.reference.norm_rope import rmsnorm_rope

__all__ = ["q_norm_rope_indexer_q"]


def q_norm_rope_indexer_q(q: torch.Tensor, iq: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          weights: torch.Tensor, eps: float, config=None):
    """``q (T, H, D)`` bf16, ``iq (T, IH, ID)`` bf16, ``weights (T, IH)`` -> ``(q_normed (T, H, D) float64,
    q_fp8 (T, IH, ID) float8_e4m3fn, w (T, IH) float32)``; ``config`` is ignored (the launcher's)."""
    q_normed = rmsnorm_rope(q, None, eps, positions, cos_sin)
    q8, w = indexer_q_rope_quant(iq, positions, cos_sin, weights)
    return q_normed, q8, w
