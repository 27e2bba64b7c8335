"""Torch references for sparse MLA with an attention sink (DeepSeek-V4, SPEC.md §2 items 6-7).

Per query token ``t`` and head ``h``, over the candidate set ``C_t`` (the valid SWA-window slots and
the valid compressed slots; ``-1`` indices and positions ``>= length`` are not candidates), with
``K = V = `` the 512-d latent read from the cache (fp8_ds_mla dequantized exactly) or a bf16 workspace:

    s_j = scale * q[t,h] . k_j                    (scale = 512^-0.5)
    M   = max(max_j s_j, sink[h])
    out = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) + exp(sink[h] - M))

A row with no candidate returns zeros. Semantics: FlashMLA ``flash_mla_with_kvcache`` (sparse FP8,
``attn_sink``) and ``flash_mla_sparse_fwd``; vLLM DeepSeek-V4 sparse SWA + compressed attention.
Everything here is float64 on the CPU.
"""
from __future__ import annotations

import torch

from ds4lab.reference.mla_cache import dequant_slots
from ds4lab.reference.norm_rope import rmsnorm_rope

DEFAULT_SCALE = 512 ** -0.5


def _valid(indices: torch.Tensor, lengths: torch.Tensor | None, n_slots: int) -> torch.Tensor:
    idx = indices.detach().cpu().long()
    n = idx.shape[1]
    ok = (idx >= 0) & (idx < n_slots)
    if lengths is not None:
        ln = lengths.detach().cpu().long().clamp(0, n)
        ok &= torch.arange(n)[None, :] < ln[:, None]
    return ok


def attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor,
           scale: float, abs_values: bool = False) -> torch.Tensor:
    """q ``(T, H, D)``, kv ``(T, N, D)`` float64, valid ``(T, N)`` bool, sink ``(H,)`` -> ``(T, H, D)`` float64.

    ``abs_values``: weight ``|v_j|`` instead of ``v_j`` (``sum_j p_j |v_j|``, same probabilities): the
    magnitude an error in the probabilities is relative to (``kernel_specs.sparse_mla.check``)."""
    q = q.detach().cpu().double()
    sink = attn_sink.detach().cpu().double()[None, :]                      # (1, H)
    s = torch.einsum("thd,tnd->thn", q, kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1) if s.shape[-1] else torch.full(s.shape[:2], float("-inf"), dtype=s.dtype), sink)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe[..., None])
    den = e.sum(-1) + torch.exp(sink - m_safe)
    num = torch.einsum("thn,tnd->thd", e, kv.abs() if abs_values else kv)
    out = num / den.clamp_min(1e-300)[..., None]
    return torch.where((den > 0)[..., None], out, torch.zeros_like(out))


def normed_q(q, q_norm_eps=None, positions=None, cos_sin=None) -> torch.Tensor:
    """The q the attention reads: ``q`` itself, or with ``q_norm_eps`` the bf16 output of the per-head
    weight-free RMSNorm + GPT-J RoPE (:func:`ds4lab.reference.norm_rope.rmsnorm_rope` in float64, then
    the one bf16 rounding the kernels' q has, as the separate ``rmsnorm_rope`` launch rounds there)."""
    if q_norm_eps is None:
        return q
    return rmsnorm_rope(q, None, q_norm_eps, positions.cpu(), cos_sin.cpu()).to(torch.bfloat16)


def sparse_mla_decode(q, swa_cache, swa_indices, swa_lens, attn_sink, comp_cache=None, comp_indices=None,
                      comp_lens=None, swa_block_size: int = 64, comp_block_size: int = 64,
                      scale: float = DEFAULT_SCALE, abs_values: bool = False, q_norm_eps=None, positions=None,
                      cos_sin=None) -> torch.Tensor:
    """fp64 reference of :func:`ds4lab_kernels.sparse_mla.sparse_mla_decode` (same arguments) ->
    ``(T, H, 512)`` float64. Reads the same cache bytes the kernel reads (``dequant_slots``).
    ``abs_values``: ``sum_j p_j |v_j|`` instead (see :func:`attend`). ``q_norm_eps`` (with
    ``positions``, ``cos_sin``): the fused q norm + RoPE, :func:`normed_q` composed before the attention."""
    q = normed_q(q.detach().cpu(), q_norm_eps, positions, cos_sin)
    shp = q.shape
    q = q.reshape(-1, *shp[-2:])
    T = q.shape[0]
    swa_indices = swa_indices.reshape(T, -1)
    kvs = [dequant_slots(swa_cache, swa_indices, swa_block_size)]
    vals = [_valid(swa_indices, swa_lens.reshape(-1), swa_cache.shape[0] * swa_block_size)]
    if comp_cache is not None:
        comp_indices = comp_indices.reshape(T, -1)
        kvs.append(dequant_slots(comp_cache, comp_indices, comp_block_size))
        vals.append(_valid(comp_indices, None if comp_lens is None else comp_lens.reshape(-1),
                           comp_cache.shape[0] * comp_block_size))
    out = attend(q, torch.cat(kvs, 1), torch.cat(vals, 1), attn_sink, scale, abs_values)
    return out.reshape(shp)


def sparse_mla_prefill(q, kv, indices, attn_sink, lengths=None, scale: float = DEFAULT_SCALE,
                       abs_values: bool = False) -> torch.Tensor:
    """fp64 reference of :func:`ds4lab_kernels.sparse_mla.sparse_mla_prefill` -> ``(Tq, H, 512)`` float64.
    ``abs_values``: ``sum_j p_j |v_j|`` instead (see :func:`attend`)."""
    kvd = kv.detach().cpu().double()
    idx = indices.detach().cpu().long()
    valid = _valid(idx, lengths, kv.shape[0])
    g = kvd[torch.where(valid, idx, torch.zeros_like(idx))]             # (Tq, K, D)
    return attend(q, g * valid[..., None], valid, attn_sink, scale, abs_values)


def score_stats(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, scale: float):
    """``(max_logits, lse)``, each ``(T, H)`` float64: the max and the natural-log ``logsumexp`` of the
    scaled scores ``scale * q . k_j`` over the valid candidates only (the sink is outside both);
    ``-inf`` / ``+inf`` for a row with none (FlashMLA ``tests/ref.py`` convention)."""
    q = q.detach().cpu().double()
    s = torch.einsum("thd,tnd->thn", q, kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    if not s.shape[-1]:
        none = torch.full(s.shape[:2], float("inf"), dtype=s.dtype)
        return -none, none
    lse = torch.logsumexp(s, -1)
    return s.amax(-1), lse.masked_fill(torch.isneginf(lse), float("inf"))


def sparse_mla_decode_lse(q, swa_cache, swa_indices, swa_lens, attn_sink=None, comp_cache=None, comp_indices=None,
                          comp_lens=None, swa_block_size: int = 64, comp_block_size: int = 64,
                          scale: float = DEFAULT_SCALE) -> torch.Tensor:
    """fp64 LSE ``(T, H)`` of :func:`sparse_mla_decode`'s scores (same arguments; the sink is not used)."""
    T = q.shape[0]
    kvs = [dequant_slots(swa_cache, swa_indices, swa_block_size)]
    vals = [_valid(swa_indices, swa_lens, swa_cache.shape[0] * swa_block_size)]
    if comp_cache is not None:
        kvs.append(dequant_slots(comp_cache, comp_indices, comp_block_size))
        vals.append(_valid(comp_indices, comp_lens, comp_cache.shape[0] * comp_block_size))
    return score_stats(q.reshape(T, *q.shape[-2:]), torch.cat(kvs, 1), torch.cat(vals, 1), scale)[1]


def sparse_mla_prefill_stats(q, kv, indices, attn_sink=None, lengths=None, scale: float = DEFAULT_SCALE):
    """fp64 ``(max_logits, lse)`` ``(Tq, H)`` of :func:`sparse_mla_prefill`'s scores (sink not used)."""
    idx = indices.detach().cpu().long()
    valid = _valid(idx, lengths, kv.shape[0])
    g = kv.detach().cpu().double()[torch.where(valid, idx, torch.zeros_like(idx))]
    return score_stats(q, g * valid[..., None], valid, scale)


# ---- benchmark baseline (torch, any device) -------------------------------------------------------
def _dequant_gather_bf16(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sm_89 forks' first step: gather + dequantize candidates into a bf16 workspace in HBM."""
    blocks = cache.reshape(cache.shape[0], -1)
    s = slots.long().clamp_min(0)
    blk, pos = s // block_size, s % block_size
    ent = blocks[blk[..., None], pos[..., None] * 576 + torch.arange(576, device=cache.device)]
    nope = ent[..., :448].contiguous().view(torch.float8_e4m3fn).float()
    sc = blocks[blk[..., None], block_size * 576 + pos[..., None] * 8 + torch.arange(7, device=cache.device)]
    scale = torch.exp2(sc.float() - 127.0)
    nope = (nope.unflatten(-1, (7, 64)) * scale[..., None]).flatten(-2)
    rope = ent[..., 448:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], -1)


def dequant_gather_bmm_decode(q, swa_cache, swa_indices, swa_lens, attn_sink, comp_cache=None,
                              comp_indices=None, comp_lens=None, swa_block_size: int = 64,
                              comp_block_size: int = 64, scale: float = DEFAULT_SCALE, **_) -> torch.Tensor:
    """Baseline row: dequantize-gather to a bf16 workspace -> bmm -> softmax (+sink) -> bmm."""
    T, H, D = q.shape
    ws = [_dequant_gather_bf16(swa_cache, swa_indices, swa_block_size)]
    n = swa_indices.shape[1]
    valid = [(torch.arange(n, device=q.device)[None] < swa_lens[:, None]) & (swa_indices >= 0)]
    if comp_cache is not None:
        ws.append(_dequant_gather_bf16(comp_cache, comp_indices, comp_block_size))
        n = comp_indices.shape[1]
        valid.append((torch.arange(n, device=q.device)[None] < comp_lens[:, None]) & (comp_indices >= 0))
    ws, valid = torch.cat(ws, 1), torch.cat(valid, 1)                   # (T, N, D) bf16
    s = torch.bmm(q, ws.transpose(1, 2)).float() * scale                # (T, H, N)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, attn_sink.float()[None, :, None].expand(T, H, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1].nan_to_num(0.0)
    return torch.bmm(p.to(torch.bfloat16), ws)


def gather_bmm_prefill(q, kv, indices, attn_sink, lengths=None, scale: float = DEFAULT_SCALE, **_):
    """Baseline row for prefill: gather bf16 rows -> bmm -> softmax (+sink) -> bmm."""
    Tq, H, D = q.shape
    ws = kv[indices.long().clamp_min(0)]                               # (Tq, K, D)
    n = indices.shape[1]
    valid = indices >= 0
    if lengths is not None:
        valid &= torch.arange(n, device=q.device)[None] < lengths[:, None]
    s = torch.bmm(q, ws.transpose(1, 2)).float() * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, attn_sink.float()[None, :, None].expand(Tq, H, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1].nan_to_num(0.0)
    return torch.bmm(p.to(torch.bfloat16), ws)


def attend_masked(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """:func:`attend` over ONE shared candidate set: q ``(T, H, D)``, kv ``(N, D)`` float64, valid
    ``(T, N)`` bool (which of the N candidates row t sees) -> ``(T, H, D)`` float64. Same formula
    (sink in the denominator, zeros for a row with no candidate); for many rows whose candidate
    sets overlap (a prefill chunk's SWA windows) it avoids gathering a ``(T, N, D)`` copy."""
    q = q.detach().cpu().double()
    sink = attn_sink.detach().cpu().double()[None, :]
    s = torch.einsum("thd,nd->thn", q, kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1) if s.shape[-1] else torch.full(s.shape[:2], float("-inf"), dtype=s.dtype), sink)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe[..., None])
    den = e.sum(-1) + torch.exp(sink - m_safe)
    out = torch.einsum("thn,nd->thd", e, kv) / den.clamp_min(1e-300)[..., None]
    return torch.where((den > 0)[..., None], out, torch.zeros_like(out))
