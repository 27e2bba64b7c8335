"""Torch reference for DeepSeek-V4 RoPE: the cos/sin table and the forward/inverse rotation.

Semantics (vLLM 0.32 ``models/deepseek_v4/common/rope.py`` ``build_deepseek_v4_rope`` and
``DeepseekV4ScalingRotaryEmbedding``): GPT-J interleaved pairs ``(2i, 2i+1)`` on the LAST
``rope_dim`` (64) dims of a head. SWA-only layers (and MTP): ``base = rope_theta`` (10000), no YaRN.
Compressed layers (C4A/C128A): ``base = compress_rope_theta`` (160000) with YaRN
(``factor``, ``original_max_position_embeddings``, ``beta_fast``/``beta_slow`` from
``rope_scaling``) and mscale disabled (1.0). The table is float32 ``(max_pos, rope_dim)`` =
``cos || sin`` of ``pos * inv_freq``, computed in float32 as vLLM computes it (so the tables agree
bit for bit). Forward: ``y0 = x0 cos - x1 sin``, ``y1 = x1 cos + x0 sin``; inverse negates ``sin``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["inv_freq", "cos_sin_cache", "layer_cos_sin", "rope_params", "apply_rope"]


def inv_freq(rope_dim: int, base: float, factor: float = 1.0, original_max: int = 2048,
             beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """float32 ``(rope_dim/2,)`` YaRN-blended inverse frequencies (plain RoPE when ``factor == 1``)."""
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def corr_dim(rot):
        return (rope_dim * math.log(original_max / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    return inter * (1 - mask) + extra * mask


def cos_sin_cache(max_pos: int, rope_dim: int, base: float, factor: float = 1.0, original_max: int = 2048,
                  beta_fast: float = 32, beta_slow: float = 1, device=None) -> torch.Tensor:
    """float32 ``(max_pos, rope_dim)``: ``cos(p f) || sin(p f)`` for positions ``0..max_pos-1``."""
    f = inv_freq(rope_dim, base, factor, original_max, beta_fast, beta_slow)
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, f)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def rope_params(cfg, compress_ratio: int) -> dict:
    """The table parameters of a layer with ``compress_ratio`` (0/1: SWA-only, else compressed)."""
    if compress_ratio > 1:
        rs = dict(cfg.extra.get("rope_scaling") or {})
        return {"base": cfg.compress_rope_theta, "factor": float(rs.get("factor", 16)),
                "original_max": int(rs.get("original_max_position_embeddings", 65536)),
                "beta_fast": rs.get("beta_fast", 32), "beta_slow": rs.get("beta_slow", 1)}
    return {"base": cfg.rope_theta, "factor": 1.0, "original_max": cfg.max_position_embeddings,
            "beta_fast": 32, "beta_slow": 1}


def layer_cos_sin(cfg, compress_ratio: int, max_pos: int, device=None) -> torch.Tensor:
    """The ``cos_sin`` table a layer of ``compress_ratio`` uses, for positions ``< max_pos``."""
    return cos_sin_cache(max_pos, cfg.qk_rope_head_dim, device=device, **rope_params(cfg, compress_ratio))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False,
               dtype=torch.float64) -> torch.Tensor:
    """``x (T, ..., d)`` -> ``dtype`` copy with the last ``rope_dim`` dims rotated by
    ``+-pos * f`` (``positions (T,)``)."""
    R = cos_sin.shape[1]
    y = x.to(dtype).clone()
    cs = cos_sin[positions.long()].to(dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cs[:, : R // 2].reshape(shape), cs[:, R // 2:].reshape(shape)
    if inverse:
        sin = -sin
    ev, od = y[..., -R::2].clone(), y[..., -R + 1::2].clone()
    y[..., -R::2] = ev * cos - od * sin
    y[..., -R + 1::2] = od * cos + ev * sin
    return y
