"""Torch references for the lightning indexer (SPEC.md §2 items 4 and 10, §3).

Indexer K cache (vLLM DeepSeek-V4 ``indexer_k_quant_and_cache`` / DeepGEMM paged layout): a cache
block holds ``block_size`` (64) compressed entries. Inside a block, entry ``i``'s 128 e4m3 values
sit at byte ``i*128`` and, *after all entries* (planar, not interleaved), its fp32 power-of-two
scale sits at byte ``block_size*128 + 4*i``. A block therefore uses ``block_size*132`` bytes and
is padded to the cache's block stride (a multiple of 576 B: 8,640 B for 64 entries).
The cache tensor is uint8 ``(num_blocks, block_size, 132)`` (or with a singleton head axis
``(num_blocks, block_size, 1, 132)``, DeepGEMM's view); its shape is only a byte view: element
``[b, i, :]`` is NOT entry ``i``'s data. Always address it as ``base + b*stride(0) + offset``.

Quantization (vLLM ``indexer_k_quant_and_cache`` with ``scale_fmt="ue8m0"``):
``s = 2^ceil(log2(max(amax(|k|), 1e-4) / 448))``, ``q = e4m3(k / s)`` (exact division by a
power of two, then RTNE; |k/s| <= 448 so no saturation is needed).

Logits (DeepGEMM ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``):
``logit[t, j] = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) * k_scale[j]`` for ``j`` in the row's
valid range, ``-inf`` elsewhere. Computed here in float64 from the exact fp8 operands.
"""
from __future__ import annotations

import torch

from ds4lab.reference.quant import ceil_pow2, to_e4m3
from ds4lab.reference.rope import apply_rope
from ds4lab.reference.topk import topk_indices as _topk_indices

__all__ = ["HEAD_DIM", "indexer_q_rope_quant", "block_bytes", "entry_offsets", "quantize_k", "indexer_k_cache_insert",
           "read_indexer_k_cache", "gather_indexer_k", "fp8_mqa_logits", "fp8_paged_mqa_logits",
           "fp8_paged_mqa_topk"]

HEAD_DIM = 128
SCALE_EPS = 1e-4


def indexer_q_rope_quant(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, weights: torch.Tensor,
                         rope_dtype=torch.float32, config=None):
    """The indexer's query side (vLLM DeepSeek-V4 ``Indexer``): ``x = bf16(rope(q))`` on the last
    ``R`` dims of each head (``rope_dtype`` math: float32 as the decode glue and the kernel,
    float64 for the model twin), ``s = ceil_pow2(max(amax|x|, 1e-4) / 448)`` per (token, head),
    ``q_fp8 = e4m3(x / s)``, ``w = (weights * s) * fp32(D^-0.5 * H^-0.5)`` in float32.
    ``q (T, H, D)`` bf16, ``weights (T, H)`` -> ``(q_fp8 (T, H, D) float8_e4m3fn, w (T, H) float32)``."""
    H, D = q.shape[1], q.shape[2]
    x = apply_rope(q, positions, cos_sin, dtype=rope_dtype).to(torch.bfloat16).to(torch.float64)
    has_nan = x.isnan().any(-1)
    s = ceil_pow2((x.abs().amax(-1).clamp_min(SCALE_EPS) / 448.0).float())
    s = torch.where(has_nan, torch.full_like(s, float("nan")), s)
    qf = to_e4m3(x / s.double()[..., None])
    scale = torch.tensor(D ** -0.5 * H ** -0.5, dtype=torch.float32)
    w = weights.float() * s * scale
    return qf, w


def block_bytes(block_size: int = 64, head_dim: int = HEAD_DIM, align: int = 576) -> int:
    """Bytes one indexer cache block occupies: ``block_size*(head_dim+4)`` padded to ``align``
    (64 entries -> 8,448 -> 8,640 B, SPEC.md §3)."""
    raw = block_size * (head_dim + 4)
    return -(-raw // align) * align


def entry_offsets(slot: int, block_stride: int, block_size: int = 64, head_dim: int = HEAD_DIM):
    """Byte offsets (from the cache base) of slot ``slot``: ``(values_offset, scale_offset)``."""
    b, i = divmod(slot, block_size)
    return b * block_stride + i * head_dim, b * block_stride + block_size * head_dim + 4 * i


def quantize_k(k: torch.Tensor):
    """bf16/fp32 ``(num_tokens, 128)`` -> ``(q float8_e4m3fn, s float32 (num_tokens,))``."""
    x = k.float()
    amax = x.abs().amax(dim=1)
    s = ceil_pow2(torch.clamp(amax, min=SCALE_EPS) / 448.0)
    return to_e4m3(x / s[:, None]), s


def _flat(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(1-D uint8 view over the whole storage from the cache's first byte, block stride, block size)."""
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    stride = kv_cache.stride(0)
    span = (nb - 1) * stride + bs * (kv_cache.shape[-1])
    flat = torch.as_strided(kv_cache, (span,), (1,))
    return flat, stride, bs


def indexer_k_cache_insert(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``kv_cache`` with each token ``t`` (``slot_mapping[t] >= 0``) quantized and
    written to slot ``slot_mapping[t]`` (block ``slot // block_size``, entry ``slot % block_size``)."""
    out = kv_cache.detach().cpu().clone()
    flat, stride, bs = _flat(out)
    q, s = quantize_k(k.detach().cpu())
    qb = q.view(torch.uint8)
    sb = s.contiguous().view(torch.uint8).view(-1, 4)
    D = k.shape[1]
    for t, slot in enumerate(slot_mapping.detach().cpu().tolist()):
        if slot < 0:
            continue
        vo, so = entry_offsets(slot, stride, bs, D)
        flat[vo:vo + D] = qb[t]
        flat[so:so + 4] = sb[t]
    return out


def read_indexer_k_cache(kv_cache: torch.Tensor, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Read entries ``slots`` back: ``(k float8_e4m3fn (n, 128), scale float32 (n,))``."""
    flat, stride, bs = _flat(kv_cache.detach().cpu())
    D = kv_cache.shape[-1] - 4
    vals, scales = [], []
    for slot in (slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)):
        vo, so = entry_offsets(int(slot), stride, bs, D)
        vals.append(flat[vo:vo + D])
        scales.append(flat[so:so + 4])
    if not vals:
        return torch.empty(0, D, dtype=torch.float8_e4m3fn), torch.empty(0)
    return (torch.stack(vals).view(torch.float8_e4m3fn),
            torch.stack(scales).contiguous().view(torch.float32).reshape(-1))


def gather_indexer_k(kv_cache: torch.Tensor, block_table_row: torch.Tensor, n: int):
    """The first ``n`` entries of one request (logical position ``j`` lives in block
    ``block_table_row[j // block_size]``, entry ``j % block_size``), vectorized on the cache's
    device: ``(k float8_e4m3fn (n, D), scale float32 (n,))``."""
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    nb, bs, width = kv_cache.shape
    D = width - 4
    stride = kv_cache.stride(0)
    dev = kv_cache.device
    flat = torch.as_strided(kv_cache, ((nb - 1) * stride + bs * width,), (1,))
    j = torch.arange(n, device=dev)
    blk = block_table_row.to(dev).long()[j // bs]
    base = blk * stride
    vals = flat[(base + (j % bs) * D)[:, None] + torch.arange(D, device=dev)[None, :]]
    sc = flat[(base + bs * D + (j % bs) * 4)[:, None] + torch.arange(4, device=dev)[None, :]]
    return vals.view(torch.float8_e4m3fn), sc.contiguous().view(torch.float32).reshape(-1)


def _logits64(q: torch.Tensor, k: torch.Tensor, ks: torch.Tensor, w: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """q ``(T, H, D)``, k ``(N, D)``, ks ``(N,)``, w ``(T, H)`` -> float64 ``(T, N)`` (chunked over T
    so the ``(chunk, H, N)`` float64 intermediate stays small)."""
    kd, ksd = k.double(), ks.double()
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float64, device=q.device)
    for t0 in range(0, q.shape[0], chunk):
        s = torch.einsum("thd,nd->thn", q[t0:t0 + chunk].double(), kd)
        out[t0:t0 + chunk] = (s.relu() * w[t0:t0 + chunk].double()[:, :, None]).sum(1) * ksd[None, :]
    return out


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke) -> torch.Tensor:
    """Ragged prefill logits (DeepGEMM ``fp8_mqa_logits``): float32 ``(num_q, num_k)``, ``-inf``
    outside ``[cu_seqlen_ks[t], cu_seqlen_ke[t])``."""
    k, ks = kv
    out = _logits64(q.float(), k.float(), ks.reshape(-1), weights)
    j = torch.arange(k.shape[0], device=q.device)
    m = (j[None, :] >= cu_seqlen_ks.long()[:, None]) & (j[None, :] < cu_seqlen_ke.long()[:, None])
    return out.masked_fill_(~m, float("-inf")).float()


def paged_row_limits(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """``(B*next_n,)`` number of valid entries per query row. ``context_lens`` ``(B, next_n)``: the
    row's own bound; ``(B,)``: DeepGEMM's convention, row ``i`` sees ``ctx - next_n + i + 1``."""
    cl = context_lens.detach().cpu().long()
    if cl.dim() == 2:
        return cl.reshape(-1)
    return (cl[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).reshape(-1)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len) -> torch.Tensor:
    """Paged decode logits (DeepGEMM ``fp8_paged_mqa_logits``): float32 ``(B*next_n, max_context_len)``;
    row ``b*next_n + i`` holds entries ``j < limit`` (``paged_row_limits``), ``-inf`` after."""
    B, nn = q.shape[0], q.shape[1]
    lim = paged_row_limits(context_lens, nn).clamp(0, max_context_len)
    out = torch.full((B * nn, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(lim[b * nn:(b + 1) * nn].max())
        if n == 0:
            continue
        k, ks = gather_indexer_k(kv_cache, block_table[b], n)
        lg = _logits64(q[b].float(), k.float(), ks, weights[b * nn:(b + 1) * nn])
        for i in range(nn):
            L = int(lim[b * nn + i])
            if L > 0:
                out[b * nn + i, :L] = lg[i, :L].float()
    return out


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, max_context_len, k=512, offsets=None):
    """Paged decode logits then their top-``k`` (the one-launch ``fp8_paged_mqa_topk``): the
    composition of :func:`fp8_paged_mqa_logits` and ``reference.topk.topk_indices`` over each row's
    limit, ``offsets[row]`` added to the selected indices (``-1`` kept). int32 ``(B*next_n, k)``."""
    lg = fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
    lim = paged_row_limits(context_lens, q.shape[1]).clamp(0, max_context_len).to(torch.int32)
    out = _topk_indices(lg, k, lim)
    if offsets is not None:
        out = torch.where(out >= 0, out + offsets.detach().cpu().to(torch.int32)[:, None], out)
    return out.to(q.device)
