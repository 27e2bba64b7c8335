"""Torch references for mHC (hyper-connections), computed in float64 by default (SPEC.md §2 item 8).

Written from vLLM's ``model_executor/kernels/mhc/torch.py`` (``mhc_pre_torch``, ``mhc_post_torch``) and the
TileLang kernels its DeepSeek-V4 model runs (``mhc_pre_big_fuse_with_norm``, ``mhc_pre_big_fuse_broadcast``,
``mhc_fused_tilelang``, ``hc_head_fuse_tilelang``), and DeepGEMM ``tf32_hc_prenorm_gemm``.

The bf16 boundaries of the model are kept: the new residual is bf16, the collapse ``y`` is rounded to bf16
before the RMSNorm (as the unfused ``rms_norm(layer_input)`` sees it), outputs are bf16. Everything else is
``compute_dtype`` (float64 for tests; the float32 version is the "torch eager" baseline on the GPU).
Never imports ``ds4lab_kernels``.
"""
from __future__ import annotations

import torch

__all__ = ["hc_prenorm_gemm", "mhc_gates", "sinkhorn", "mhc_pre", "mhc_pre_broadcast", "add_bf16", "mhc_post",
           "mhc_fused_post_pre", "hc_head"]


def hc_prenorm_gemm(x, fn, num_splits=None, precision="tf32", compute_dtype=torch.float64, **_):
    """``(mixes [1, T, N], sqrsum [1, T])`` float32: one "split" holding the full sums."""
    xf = x.to(compute_dtype)
    mixes = xf @ fn.to(compute_dtype).t()
    sq = xf.square().sum(-1)
    return mixes.float().unsqueeze(0), sq.float().unsqueeze(0)


def sinkhorn(logits, iters: int, eps: float):
    """Row softmax + eps, column normalise, then ``iters - 1`` (row, column) normalisations of ``[.., 4, 4]``.
    Each normalisation divides by ``(sum + eps)`` (vLLM ``mhc_pre_torch``)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def mhc_gates(mixes, sqrsum, numel, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
              sinkhorn_iters, hc=4):
    """Full mixes ``[T, 24]`` and sums of squares ``[T]`` -> ``(pre [T,4], post [T,4], comb [T,4,4])``."""
    dt = mixes.dtype
    s, b = hc_scale.to(dt), hc_base.to(dt)
    m = mixes * torch.rsqrt(sqrsum / numel + rms_eps).unsqueeze(-1)
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_pre_eps
    post = torch.sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc]) * hc_post_mult
    logits = m[:, 2 * hc:].reshape(-1, hc, hc) * s[2] + b[2 * hc:].reshape(1, hc, hc)
    return pre, post, sinkhorn(logits, sinkhorn_iters, hc_sinkhorn_eps)


def _collapse(residual, pre, norm_weight, norm_eps, dt):
    y = (pre.unsqueeze(-1) * residual.to(dt)).sum(dim=1).to(torch.bfloat16)   # the model's bf16 boundary
    if norm_weight is None:
        return y
    yf = y.to(dt)
    inv = torch.rsqrt(yf.square().mean(-1, keepdim=True) + norm_eps)
    return (yf * inv * norm_weight.to(dt)).to(torch.bfloat16)


def mhc_pre(residual, fn, hc_scale, hc_base, norm_weight=None, rms_eps=1e-6, hc_pre_eps=1e-6,
            hc_sinkhorn_eps=1e-6, hc_post_mult=2.0, sinkhorn_iters=20, norm_eps=1e-6,
            compute_dtype=torch.float64, **_):
    """``(post [T,4,1] f32, comb [T,4,4] f32, layer_input [T,D] bf16)``."""
    T, hc, D = residual.shape
    dt = compute_dtype
    x = residual.reshape(T, hc * D).to(dt)
    mixes = x @ fn.to(dt).t()
    pre, post, comb = mhc_gates(mixes, x.square().sum(-1), hc * D, hc_scale, hc_base, rms_eps, hc_pre_eps,
                                hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, hc)
    out = _collapse(residual, pre, norm_weight, norm_eps, dt)
    return post.float().unsqueeze(-1), comb.float(), out


def mhc_pre_broadcast(x, fn, hc_scale, hc_base, norm_weight=None, rms_eps=1e-6, hc_pre_eps=1e-6,
                      hc_sinkhorn_eps=1e-6, hc_post_mult=2.0, sinkhorn_iters=20, norm_eps=1e-6,
                      fn_broadcast=None, compute_dtype=torch.float64, **_):
    """Layer 0: ``mhc_pre`` of the 4-copy residual (written out literally, no broadcast shortcut)."""
    T, D = x.shape
    hc = fn.shape[1] // D
    residual = x.unsqueeze(1).expand(T, hc, D).contiguous()
    return (residual, *mhc_pre(residual, fn, hc_scale, hc_base, norm_weight, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                               hc_post_mult, sinkhorn_iters, norm_eps, compute_dtype=compute_dtype))


def add_bf16(x, x2):
    """The MoE's final add as the model rounds it: ``(x.float() + x2.float()).to(bfloat16)``; ``x`` when
    ``x2`` is None."""
    return x if x2 is None else (x.float() + x2.float()).to(torch.bfloat16)


def mhc_post(x, residual, post_mix, comb_mix, out=None, compute_dtype=torch.float64, x2=None, **_):
    """``new[t, j] = sum_i comb[t, i, j] residual[t, i] + post[t, j] x[t]`` -> bf16 ``[T, 4, D]``; with ``x2``
    the sublayer output is :func:`add_bf16` ``(x, x2)`` (routed + shared expert)."""
    x = add_bf16(x, x2)
    dt = compute_dtype
    T, hc, D = residual.shape
    new = torch.einsum("tij,tid->tjd", comb_mix.to(dt), residual.to(dt))
    new = new + post_mix.reshape(T, hc, 1).to(dt) * x.to(dt).unsqueeze(1)
    return new.to(torch.bfloat16)


def mhc_fused_post_pre(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight=None, rms_eps=1e-6,
                       hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult=2.0, sinkhorn_iters=20, norm_eps=1e-6,
                       compute_dtype=torch.float64, x2=None, quant_out=False, **_):
    """``residual_cur = mhc_post(...)`` (bf16, ``x2`` as there), then ``mhc_pre(residual_cur, ...)``;
    ``quant_out``: also ``(fp8, ue8m0 bytes)`` of the layer input, ``per_token_group_quant_fp8(., 128, "ue8m0")``."""
    cur = mhc_post(x, residual, post_mix, comb_mix, compute_dtype=compute_dtype, x2=x2)
    outs = (cur, *mhc_pre(cur, fn, hc_scale, hc_base, norm_weight, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                          hc_post_mult, sinkhorn_iters, norm_eps, compute_dtype=compute_dtype))
    if not quant_out:
        return outs
    from ds4lab.reference.quant import per_token_group_quant_fp8
    return (*outs, per_token_group_quant_fp8(outs[3], 128, scale_fmt="ue8m0", eps=1e-10))


def hc_head(residual, fn, hc_scale, hc_base, rms_eps=1e-6, hc_eps=1e-6, compute_dtype=torch.float64, **_):
    """``bf16(sum_i (sigmoid(mix_i rsqrt(mean(res^2)+eps) scale + base_i) + hc_eps) res_i)`` ``[T, D]``."""
    T, hc, D = residual.shape
    dt = compute_dtype
    x = residual.reshape(T, hc * D).to(dt)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid((x @ fn.to(dt).t()) * r * hc_scale.to(dt)[0] + hc_base.to(dt)) + hc_eps
    return (pre.unsqueeze(-1) * residual.to(dt)).sum(1).to(torch.bfloat16)
