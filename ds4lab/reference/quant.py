"""Torch reference for per-token-group FP8 quantization and its scale encodings.

Semantics: vLLM ``per_token_group_quant_fp8`` and DeepGEMM ``per_token_cast_to_fp8`` (with
``use_ue8m0``: the scale is rounded up to a power of two and stored as its exponent byte).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even with saturation to ±448 (NaN kept)."""
    return x.to(torch.float64).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (positive fp32), computed exactly via frexp."""
    m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    p2 = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
    return torch.where(s.isfinite(), p2, s)  # NaN and inf stay as they are


def group_scales(x: torch.Tensor, group_size: int = 128, scale_fmt: str = "fp32", eps: float = 1e-10):
    """fp32 scales ``[M, K/group_size]`` (``scale_fmt`` fp32 or pow2 math)."""
    M, K = x.shape
    xg = x.float().reshape(M, K // group_size, group_size)
    amax = xg.abs().amax(dim=-1)
    amax = torch.where(xg.isnan().any(-1), torch.full_like(amax, float("nan")), amax)
    # fp32 division correctly rounded on every device (torch may turn a CUDA division by a scalar
    # into a multiply by its reciprocal, 1 ulp off): divide in float64, round once to float32
    s = (torch.clamp_min(amax, eps).double() / E4M3_MAX).float()
    s = torch.where(amax.isnan(), amax, s)
    if scale_fmt != "fp32":
        s = ceil_pow2(s)
    return s


def encode_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales -> UE8M0 exponent bytes (uint8); NaN -> 255."""
    b = (s.view(torch.int32) >> 23) & 0xFF
    return torch.where(s.isnan(), torch.full_like(b, 255), b).to(torch.uint8)


def decode_ue8m0(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 ``2^(b-127)`` (b=0 -> 0.0, b=255 -> NaN)."""
    out = (b.to(torch.int32) << 23).view(torch.float32)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def pack_ue8m0(b: torch.Tensor) -> torch.Tensor:
    """``[M, G]`` uint8 -> ``[M, ceil(G/4)]`` int32, four bytes per word, little-endian along G."""
    M, G = b.shape
    padded = torch.zeros((M, 4 * ((G + 3) // 4)), dtype=torch.uint8, device=b.device)
    padded[:, :G] = b
    w = padded.to(torch.int64).reshape(M, -1, 4)
    v = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def unpack_ue8m0(p: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`."""
    v = p.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(p.shape[0], -1)
    return b[:, :groups].to(torch.uint8)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128, scale_fmt: str = "fp32",
                              eps: float = 1e-10, config=None):
    """Reference of ``ds4lab_kernels.fp8_quant.per_token_group_quant_fp8`` (same signature)."""
    M, K = x.shape
    s = group_scales(x, group_size, scale_fmt, eps)
    # the kernel's fp32 quotient x/s, correctly rounded (as tl.math.div_rn), then RTNE to e4m3
    xs = (x.double().reshape(M, K // group_size, group_size) / s.double()[..., None]).float()
    q = to_e4m3(xs.reshape(M, K))
    if scale_fmt in ("fp32", "pow2"):
        return q, s
    b = encode_ue8m0(s)
    return (q, b) if scale_fmt == "ue8m0" else (q, pack_ue8m0(b))


def dequant(q: torch.Tensor, s: torch.Tensor, group_size: int = 128, scale_fmt: str = "fp32") -> torch.Tensor:
    """``q * s`` broadcast over groups, in fp32 (any scale format)."""
    M, K = q.shape
    G = K // group_size
    if scale_fmt == "ue8m0":
        s = decode_ue8m0(s)
    elif scale_fmt == "ue8m0_packed":
        s = decode_ue8m0(unpack_ue8m0(s, G))
    return (q.float().reshape(M, G, group_size) * s[..., None]).reshape(M, K)
