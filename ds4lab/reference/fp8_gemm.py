"""Torch reference for the block-scaled FP8 GEMM (DeepGEMM ``fp8_gemm_nt``) and 128x128 weight quant.

Semantics (DeepGEMM ``fp8_gemm_nt``, vLLM ``w8a8_triton_block_scaled_mm`` / ``W8A8BlockFp8LinearOp``
with ``block_size=[128, 128]``): ``A`` ``(M, K)`` e4m3 with one scale per row and 128-wide k-block,
``B`` ``(N, K)`` e4m3 with one scale per 128x128 block, and

    D[m, n] = sum_kb  (sum_{k in kb} A[m, k] * B[n, k]) * sA[m, kb] * sB[n // 128, kb]

returned in bf16 by the kernel. Scale encodings (by dtype): float32 (plain or power-of-two),
uint8 UE8M0 exponent bytes (``2^(b-127)``, ``b=0 -> 0``, ``b=255 -> NaN``; also
``torch.float8_e8m0fnu``), int32 with four UE8M0 bytes per word (little-endian along the k-block
axis, DeepGEMM's packed layout). Written for clarity: one product per k-block in float64 on CPU,
float32 on CUDA (no TF32). Never imports ``ds4lab_kernels``.
"""
from __future__ import annotations

import torch

from ds4lab.reference.quant import ceil_pow2, decode_ue8m0, encode_ue8m0, pack_ue8m0, unpack_ue8m0

BLOCK = 128
E4M3_MAX = 448.0
SCALE_FMTS = ("fp32", "pow2", "ue8m0", "ue8m0_packed")


def decode_scales(s: torch.Tensor, groups: int) -> torch.Tensor:
    """Any scale encoding ``(rows, groups)`` (int32 packed: ``(rows, ceil(groups/4))``) -> float32."""
    if s.dtype == getattr(torch, "float8_e8m0fnu", None):
        s = s.view(torch.uint8)
    if s.dtype == torch.float32:
        return s
    if s.dtype == torch.uint8:
        return decode_ue8m0(s)
    if s.dtype == torch.int32:
        return decode_ue8m0(unpack_ue8m0(s, groups))
    raise TypeError(f"scale dtype {s.dtype}: expected float32, uint8 (UE8M0) or int32 (packed UE8M0)")


def encode_scales(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 scales -> the ``fmt`` encoding (``pow2``/``ue8m0``/packed round up to a power of two)."""
    if fmt == "fp32":
        return s
    if fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={fmt!r}: expected one of {SCALE_FMTS}")
    p = ceil_pow2(s)
    if fmt == "pow2":
        return p
    b = encode_ue8m0(p)
    return b if fmt == "ue8m0" else pack_ue8m0(b)


def per_block_quant_fp8(w: torch.Tensor, scale_fmt: str = "fp32", eps: float = 1e-10):
    """Weight ``(N, K)`` -> ``(q (N, K) e4m3, s (ceil(N/128), K/128))`` with 128x128 blocks.

    ``s = max(amax(block), eps) / 448`` (rounded up to a power of two for pow2/ue8m0), the partial
    last block of rows uses its own amax. Same rule as DeepGEMM ``per_block_cast_to_fp8``.
    """
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"w: K={K} is not a multiple of {BLOCK}")
    NB = -(-N // BLOCK)
    pad = torch.zeros(NB * BLOCK, K, dtype=torch.float32, device=w.device)
    pad[:N] = w.float()
    blocks = pad.view(NB, BLOCK, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(eps)
    s = amax / E4M3_MAX
    if scale_fmt != "fp32":
        s = ceil_pow2(s)
    q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(NB * BLOCK, K)[:N].contiguous()
    return q, encode_scales(s, scale_fmt)


def fp8_gemm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out=None, config=None) -> torch.Tensor:
    """Reference of ``ds4lab_kernels.fp8_gemm.fp8_gemm_nt`` (same arguments); returns float32 ``(M, N)``
    (the kernel rounds the same value to bf16)."""
    M, K = a.shape
    N = b.shape[0]
    G = K // BLOCK
    dt = torch.float64 if a.device.type == "cpu" else torch.float32
    sa = decode_scales(a_scale, G).to(dt)                              # (M, G)
    sb = decode_scales(b_scale, G).to(dt).repeat_interleave(BLOCK, 0)[:N]  # (N, G)
    af, bf = a.to(dt), b.to(dt)
    d = torch.zeros(M, N, dtype=dt, device=a.device)
    for kb in range(G):
        ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
        d += (af[:, ks] @ bf[:, ks].T) * sa[:, kb, None] * sb[None, :, kb]
    return d.float()


def w8a8_block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out=None,
                          config=None, eps: float = 1e-10, fused=None) -> torch.Tensor:
    """Reference of ``ds4lab_kernels.fp8_gemm.w8a8_block_fp8_linear``: the 1x128 UE8M0 activation
    quant (``ds4lab.reference.quant.per_token_group_quant_fp8``, ``scale_fmt="ue8m0"``) followed by
    :func:`fp8_gemm_nt`; float32 ``(M, N)``."""
    from ds4lab.reference.quant import per_token_group_quant_fp8
    q, s = per_token_group_quant_fp8(x, BLOCK, "ue8m0", eps=eps)
    return fp8_gemm_nt(q, s, weight, weight_scale)
