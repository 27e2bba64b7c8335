"""Torch references for the DeepSeek-V4 o-projection (SPEC.md §2 item 3).

Semantics: vLLM ``deep_gemm_fp8_o_proj`` / ``fused_inv_rope_fp8_quant`` (DeepSeek-V4 attention
``_o_proj``) and DeepGEMM ``fp8_einsum("bhr,hdr->bhd")`` with recipe ``(1, 128, 128)``.

- inverse GPT-J RoPE on the last ``rope_dim`` dims of each head: pairs ``(2i, 2i+1)``,
  ``y[2i] = x[2i] cos_i + x[2i+1] sin_i``, ``y[2i+1] = x[2i+1] cos_i - x[2i] sin_i`` in float32, with
  ``cos_sin_cache[pos] = cos || sin`` (vLLM ``DeepseekV4ScalingRotaryEmbedding``). Each product is
  rounded to fp32 before the add (no FMA), which is also what the kernel computes, so the
  quantized bytes are comparable exactly.
- 1x128 FP8 quant of the rotated ``[T, G, 8*512]`` view: :mod:`ds4lab.reference.quant`.
- grouped product in float64 from the dequantized operands, rounded once to bfloat16.
"""
from __future__ import annotations

import torch

from ds4lab.reference.quant import decode_ue8m0, per_token_group_quant_fp8

GROUP = 128


def inv_rope(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``o[T, H, D]`` -> float32 with the last ``rope_dim`` dims of every head rotated by ``-theta``."""
    x = o.float().clone()
    R = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()].float()           # [T, R]
    cos, sin = cs[:, : R // 2][:, None, :], cs[:, R // 2:][:, None, :]  # [T, 1, R/2]
    rope = x[..., -R:]
    ev, od = rope[..., 0::2], rope[..., 1::2]
    new_ev = ev * cos + od * sin
    new_od = od * cos - ev * sin
    x[..., -R::2] = new_ev
    x[..., -R + 1::2] = new_od
    return x


def inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group=8, quantize=True, scale_fmt="ue8m0",
                       eps=1e-10, check_positions=True, config=None):
    """Reference of ``ds4lab_kernels.o_proj.inv_rope_fp8_quant`` (same signature and outputs)."""
    T, H, D = o.shape
    G, K = H // heads_per_group, heads_per_group * D
    x = inv_rope(o, positions, cos_sin_cache).reshape(T, G * K)
    if not quantize:
        return x.to(torch.bfloat16).reshape(T, G, K)
    q, s = per_token_group_quant_fp8(x, GROUP, scale_fmt=scale_fmt, eps=eps)
    return q.reshape(T, G, K), s.reshape(T, G, K // GROUP)


def _scale_f64(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == getattr(torch, "float8_e8m0fnu", None):
        s = s.view(torch.uint8)
    return (decode_ue8m0(s) if s.dtype == torch.uint8 else s.float()).double()


def dequant_act(x: torch.Tensor, x_s: torch.Tensor | None) -> torch.Tensor:
    """``[T, G, K]`` fp8 + ``[T, G, K/128]`` scales -> float64 (bf16 input without scales: upcast)."""
    if x_s is None:
        return x.double()
    T, G, K = x.shape
    return (x.double().reshape(T, G, K // GROUP, GROUP) * _scale_f64(x_s)[..., None]).reshape(T, G, K)


def dequant_weight(w: torch.Tensor, w_s: torch.Tensor | None) -> torch.Tensor:
    """``[G, N, K]`` fp8 + ``[G, N/128, K/128]`` block scales -> float64."""
    if w_s is None:
        return w.double()
    s = _scale_f64(w_s)
    s = s.repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)
    return w.double() * s[:, : w.shape[1], : w.shape[2]]


def fp8_einsum_bhr_hdr_bhd(x, x_s, wo_a, wo_a_s, out=None, config=None):
    """Reference of the grouped product: float64 from dequantized operands, bf16 out."""
    xd = dequant_act(x, x_s)                      # [T, G, K]
    wd = dequant_weight(wo_a, wo_a_s)             # [G, N, K]
    z = torch.einsum("tgk,gnk->tgn", xd, wd)
    return z.to(torch.bfloat16)


def bf16_einsum_bhr_hdr_bhd(x, wo_a, out=None, config=None):
    return fp8_einsum_bhr_hdr_bhd(x, None, wo_a, None)


def o_proj(o, positions, cos_sin_cache, wo_a, wo_b, wo_a_s=None, wo_b_s=None, heads_per_group=8,
           scale_fmt="ue8m0", check_positions=True, config=None):
    """Reference of the whole o-projection (both paths), with the same rounding points as vLLM:
    rotated activations quantized (FP8) or rounded to bf16, ``z`` rounded to bf16, ``z`` quantized
    1x128 for an FP8 ``wo_b``, output rounded to bf16."""
    T, H, D = o.shape
    G, K = H // heads_per_group, heads_per_group * D
    if wo_a.dim() == 2:
        wo_a = wo_a.reshape(G, -1, K)
    R = wo_a.shape[1]
    if wo_a_s is not None and wo_a_s.dim() == 2:
        wo_a_s = wo_a_s.reshape(G, R // GROUP, -1)
    if wo_a_s is not None:
        x, xs = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, True, scale_fmt)
    else:
        x, xs = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, False), None
    z = fp8_einsum_bhr_hdr_bhd(x, xs, wo_a, wo_a_s).reshape(T, G * R)
    N = wo_b.shape[0]
    if wo_b_s is not None:
        zq, zs = per_token_group_quant_fp8(z, GROUP, scale_fmt=scale_fmt)
        out = fp8_einsum_bhr_hdr_bhd(zq.reshape(T, 1, G * R), zs.reshape(T, 1, -1),
                                     wo_b.reshape(1, N, G * R), wo_b_s.reshape(1, N // GROUP, -1))
    else:
        out = fp8_einsum_bhr_hdr_bhd(z.reshape(T, 1, G * R), None, wo_b.reshape(1, N, G * R), None)
    return out.reshape(T, N)


# ---- bench baselines (torch only, run on CUDA) ---------------------------------------------------
def torch_dequant_bmm(x, x_s, wo_a, wo_a_s):
    """What the sm_89 community forks do: dequantize to bf16, then ``torch.bmm`` (timed whole)."""
    T, G, K = x.shape
    if x_s is None:
        xb, wb = x, wo_a
    else:
        xs = decode_ue8m0(x_s) if x_s.dtype == torch.uint8 else x_s
        xb = (x.float().view(T, G, K // GROUP, GROUP) * xs[..., None]).view(T, G, K).bfloat16()
        ws = decode_ue8m0(wo_a_s) if wo_a_s.dtype == torch.uint8 else wo_a_s
        wb = (wo_a.float().view(G, wo_a.shape[1] // GROUP, GROUP, K // GROUP, GROUP)
              * ws[:, :, None, :, None]).view(G, wo_a.shape[1], K).bfloat16()
    return torch.bmm(xb.transpose(0, 1), wb.transpose(1, 2)).transpose(0, 1)


def torch_inv_rope_quant(o, positions, cos_sin_cache, heads_per_group=8, quantize=True, scale_fmt="ue8m0"):
    """Eager torch inverse RoPE + 1x128 quant in fp32 (the unfused baseline)."""
    return inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, quantize, scale_fmt)
