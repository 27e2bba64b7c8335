"""Torch reference for the fp8_ds_mla KV cache: writer and byte-level reader.

Layout (SPEC.md §3; vLLM ``quantize_and_insert_k_cache``): a block of ``block_size`` entries; entry
``i`` at byte ``i*576`` holds 448 float8_e4m3fn NoPE values then 64 bf16 RoPE values; after all
entries, at ``block_size*576 + i*8``, 7 UE8M0 exponent bytes (one per 64 NoPE dims,
``scale = 2^(b-127)``) and one zero pad byte. Blocks are ``cache.stride(0)`` bytes apart.
"""
from __future__ import annotations

import torch

from ds4lab.reference.quant import ceil_pow2, to_e4m3

NOPE, ROPE, TILE = 448, 64, 64
ENTRY, SCALES = 576, 8
AMAX_FLOOR = 1e-4


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, block_bytes)`` uint8 view of the cache (no copy)."""
    return cache.reshape(cache.shape[0], -1) if cache.dim() != 2 else cache


def quantize_entry(kv: torch.Tensor):
    """``(T, 512)`` bf16 -> (``(T, 448)`` e4m3, ``(T, 7)`` UE8M0 bytes, ``(T, 64)`` bf16)."""
    x = kv.float()
    T = x.shape[0]
    g = x[:, :NOPE].reshape(T, NOPE // TILE, TILE)
    amax = g.abs().amax(-1).clamp_min(AMAX_FLOOR)
    s = ceil_pow2(amax / 448.0)                       # fp32 division, as the kernel does
    q = to_e4m3(g / s[..., None]).reshape(T, NOPE)
    b = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return q, b, kv[:, NOPE:]


def fp8_ds_mla_insert(kv: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                      block_size: int = 64) -> torch.Tensor:
    """Reference writer: a NEW cache equal to ``kv_cache`` with the tokens' entries written
    (the input is not modified). ``slot_mapping`` ``-1`` or out-of-range slots are skipped."""
    out = kv_cache.detach().cpu().clone()
    blocks = _block_bytes(out)
    T = slot_mapping.shape[0]
    q, b, rope = quantize_entry(kv[:T].detach().cpu())
    n_slots = out.shape[0] * block_size
    for t, slot in enumerate(slot_mapping.detach().cpu().tolist()):
        if slot < 0 or slot >= n_slots:
            continue
        blk, pos = divmod(slot, block_size)
        row = blocks[blk]
        e = pos * ENTRY
        row[e:e + NOPE] = q[t].view(torch.uint8)
        row[e + NOPE:e + ENTRY] = rope[t].contiguous().view(torch.uint8)
        sc = block_size * ENTRY + pos * SCALES
        row[sc:sc + 7] = b[t]
        row[sc + 7] = 0
    return out.to(kv_cache.device)


def written_mask(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool ``(num_blocks, block_bytes)``: the bytes a write of ``slot_mapping`` may touch."""
    m = torch.zeros(_block_bytes(kv_cache).shape, dtype=torch.bool)
    n_slots = kv_cache.shape[0] * block_size
    for slot in slot_mapping.detach().cpu().tolist():
        if 0 <= slot < n_slots:
            blk, pos = divmod(slot, block_size)
            m[blk, pos * ENTRY:(pos + 1) * ENTRY] = True
            sc = block_size * ENTRY + pos * SCALES
            m[blk, sc:sc + SCALES] = True
    return m


def dequant_slots(kv_cache: torch.Tensor, slots: torch.Tensor, block_size: int,
                  dtype=torch.float64) -> torch.Tensor:
    """Read entries back: ``slots`` any int shape -> ``(*slots.shape, 512)`` in ``dtype``.
    Slots ``< 0`` or outside the cache read as zeros. UE8M0 byte ``b`` decodes to ``2^(b-127)``."""
    blocks = _block_bytes(kv_cache.detach().cpu())
    flat = slots.detach().cpu().reshape(-1).long()
    n_slots = blocks.shape[0] * block_size
    ok = (flat >= 0) & (flat < n_slots)
    f = torch.where(ok, flat, torch.zeros_like(flat))
    blk, pos = f // block_size, f % block_size
    ar = torch.arange(ENTRY)
    ent = blocks[blk[:, None], pos[:, None] * ENTRY + ar[None, :]]           # (n, 576) bytes
    nope = ent[:, :NOPE].contiguous().view(torch.float8_e4m3fn).to(dtype)
    rope = ent[:, NOPE:].contiguous().view(torch.bfloat16).to(dtype)
    sc = blocks[blk[:, None], block_size * ENTRY + pos[:, None] * SCALES + torch.arange(7)[None, :]]
    scale = torch.pow(torch.tensor(2.0, dtype=dtype), sc.to(dtype) - 127.0)
    nope = (nope.reshape(-1, 7, TILE) * scale[..., None]).reshape(-1, NOPE)
    out = torch.cat([nope, rope], dim=1) * ok[:, None].to(dtype)
    return out.reshape(*slots.shape, NOPE + ROPE)
