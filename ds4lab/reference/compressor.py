"""Torch reference for the DeepSeek-V4 KV compressor (main attention, head 512; indexer, head 128).

Semantics (vLLM 0.32 ``models/deepseek_v4/compressor.py`` ``DeepseekCompressor.forward``,
``common/ops/save_partial_states.py`` and ``common/ops/fused_compress_quant_cache.py``
``_fused_kv_compress_norm_rope_insert_{sparse,indexer}_attn``), ratio ``r`` (4 or 128),
``coff = 2`` with overlap (ratio 4) else 1, head ``hd``:

1. ``kv, score = split(x @ [wkv; wgate]^T)`` (bf16 GEMM, then float32), each ``coff*hd`` wide;
   every token's state is ``(kv, score + ape[pos % r])`` (float32).
2. At a boundary ``(pos + 1) % r == 0`` the window is positions ``pos - coff*r + 1 .. pos``
   (negative positions masked out, score ``-inf``). Window element ``i`` reads the FIRST ``hd``
   half of its state when ``i < r`` and the second half when ``i >= r`` (overlap: the older block
   contributes its first half, the current block its second). Per dim, ``softmax`` over the
   window of the scores weighs the kv values: ``c = sum_i softmax_i(score) kv_i``.
3. ``n = c rsqrt(mean(c^2) + eps) w`` (RMSNorm, float32 in vLLM), then forward GPT-J RoPE on the
   last 64 dims at position ``(pos // r) * r``, then bf16: the compressed entry
   ``j = (pos + 1) // r - 1``. The cache writers quantize it (fp8_ds_mla for hd 512: UE8M0 per 64
   of the bf16 values; indexer K for hd 128: one pow2 scale), which is exactly what vLLM's fused
   kernels store (their quant input is the same bf16 rounding).

Here in float64 on the state values; never imports ``ds4lab_kernels``.
"""
from __future__ import annotations

import torch

from ds4lab.reference.rope import apply_rope

__all__ = ["state_rows", "window_positions", "compress_window", "norm_rope", "compress", "compress_decode",
           "compress_decode_insert"]


def state_rows(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
               ratio: int) -> torch.Tensor:
    """float32 ``(T, 2*coff*hd)`` state rows ``kv || score + ape[pos % ratio]``."""
    a = ape.float()[positions.long() % ratio]
    return torch.cat([kv.float(), score.float() + a], dim=-1)


def window_positions(positions: torch.Tensor, ratio: int, coff: int) -> torch.Tensor:
    """int64 ``(T, coff*ratio)``: the window ``pos - coff*ratio + 1 + i`` (negative = masked)."""
    W = coff * ratio
    return positions.long()[:, None] - W + 1 + torch.arange(W, device=positions.device)[None, :]


def compress_window(states: torch.Tensor, valid: torch.Tensor, hd: int, ratio: int, coff: int) -> torch.Tensor:
    """``states (T, W, 2*coff*hd)`` window states, ``valid (T, W)`` -> float64 ``(T, hd)``."""
    st = states.double()
    W = coff * ratio
    width = coff * hd
    second = (torch.arange(W, device=st.device) >= ratio)[None, :, None]
    kv = torch.where(second, st[..., hd:2 * hd] if coff == 2 else st[..., :hd], st[..., :hd])
    sc = torch.where(second, st[..., width + hd:width + 2 * hd] if coff == 2 else st[..., width:width + hd],
                     st[..., width:width + hd])
    sc = sc.masked_fill(~valid[..., None], float("-inf"))
    p = torch.softmax(sc, dim=1)
    return (p * kv.masked_fill(~valid[..., None], 0.0)).sum(1)


def norm_rope(c: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, ratio: int,
              cos_sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm + RoPE at ``(pos // ratio) * ratio`` -> bf16 ``(T, hd)``."""
    c = c.double()
    n = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + eps) * weight.double()
    cpos = (positions.long() // ratio) * ratio
    return apply_rope(n, cpos, cos_sin).to(torch.bfloat16)


def compress(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, ratio: int, cos_sin: torch.Tensor) -> torch.Tensor:
    """One request's whole history at once (positions ``0..L-1`` in order): ``kv, score (L, coff*hd)``
    -> the ``L // ratio`` compressed entries, bf16 ``(L // ratio, hd)``. For tests and clarity; the
    model's ops run the same math over a state ring (:func:`compress_window`)."""
    coff = 2 if ratio == 4 else 1
    hd = kv.shape[1] // coff
    st = state_rows(kv, score, ape, positions, ratio)
    b = ((positions + 1) % ratio == 0).nonzero().squeeze(1)
    win = window_positions(positions[b], ratio, coff)
    valid = win >= 0
    states = st[win.clamp_min(0)]
    c = compress_window(states, valid, hd, ratio, coff)
    return norm_rope(c, norm_weight, eps, positions[b], ratio, cos_sin)


def compress_decode(kv_score: torch.Tensor, positions: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                    window_slots: torch.Tensor, window_valid: torch.Tensor, ape: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, ratio: int, cos_sin: torch.Tensor) -> torch.Tensor:
    """The model op's contract over a state ring (what ``ds4lab_kernels.compressor.compress_decode``
    computes): write every token's state row ``state[state_slots]`` (float32, in place; slots outside
    the ring skipped), then compress each token's window ``window_slots (T, coff*ratio)`` (masked by
    ``window_valid``) -> bf16 ``(T, hd)``, zeros off a boundary. Float64 math on the state values."""
    coff = 2 if ratio == 4 else 1
    width = kv_score.shape[1] // 2
    hd = width // coff
    rows = state_rows(kv_score[:, :width], kv_score[:, width:], ape, positions, ratio)
    ok = (state_slots >= 0) & (state_slots < state.shape[0])
    state[state_slots[ok].long()] = rows[ok].to(state.dtype)
    out = torch.zeros(kv_score.shape[0], hd, dtype=torch.bfloat16, device=kv_score.device)
    b = ((positions + 1) % ratio == 0).nonzero().squeeze(1)
    if len(b):
        st = state[window_slots[b].long().clamp_min(0)]
        c = compress_window(st, window_valid[b], hd, ratio, coff)
        out[b] = norm_rope(c, norm_weight, eps, positions[b], ratio, cos_sin)
    return out


def compress_decode_insert(kv_score: torch.Tensor, positions: torch.Tensor, state: torch.Tensor,
                           state_slots: torch.Tensor, window_slots: torch.Tensor, window_valid: torch.Tensor,
                           ape: torch.Tensor, norm_weight: torch.Tensor, eps: float, ratio: int, cos_sin: torch.Tensor,
                           cache: torch.Tensor, cache_slots: torch.Tensor, block_size: int | None = None):
    """:func:`compress_decode` (state written in place), then the boundary rows' entries inserted at
    ``cache_slots`` (``-1`` elsewhere): hd 512 through :func:`ds4lab.reference.mla_cache.fp8_ds_mla_insert`
    (``block_size``), hd 128 through :func:`ds4lab.reference.indexer.indexer_k_cache_insert`. Returns a
    NEW cache (the input cache is not modified)."""
    from ds4lab.reference.indexer import indexer_k_cache_insert
    from ds4lab.reference.mla_cache import fp8_ds_mla_insert
    out = compress_decode(kv_score, positions, state, state_slots, window_slots, window_valid, ape, norm_weight,
                          eps, ratio, cos_sin)
    slots = torch.where((positions + 1) % ratio == 0, cache_slots.long(), -1)
    if out.shape[1] == 128:
        return indexer_k_cache_insert(out, cache, slots)
    return fp8_ds_mla_insert(out, slots, cache, block_size)
