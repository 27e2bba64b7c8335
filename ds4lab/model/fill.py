"""Benchmark fill of one rank's caches to a context length (issue 19 item 3: "fill the caches to ctx").

Every request of the batch holds ``ctx`` tokens (positions ``0..ctx-1``) in every layer:

- SWA ring: the last ``min(ctx, swa_ring)`` positions, random unit-RMS bf16 latents ``(., 512)``
  written by the backend's fp8_ds_mla writer (``Backend.mla_cache_write``: the ds4lab kernel on
  the kernel backend);
- compressed KV (C4A/C128A): entries ``j < ctx // ratio``, random latents through the same writer
  (block 64 for C4, 2 for C128);
- indexer K (C4A): entries ``j < ctx // 4``, random ``(., 128)`` keys through the indexer writer
  (``Backend.indexer_cache_write``);
- compressor states (fp32 rows ``kv || score``, the compressor's own storage): random normal rows,
  so the first decode step's compressor window reads plausible values.

Random latents are drawn once per size (in chunks of :data:`CHUNK_ROWS` rows) and written into every
layer: the numbers do not matter for timing, the bytes and layouts do. Being written by the real
writers, the caches hold exactly the layouts the attention and indexer kernels read.
"""
from __future__ import annotations

import torch

from ds4lab.model.cache import Caches, LayerCache

__all__ = ["fill_caches", "fill_layer", "CHUNK_ROWS"]

CHUNK_ROWS = 1 << 16


def _rand(gen, rows, width, device):
    return torch.randn(rows, width, generator=gen, device=device).to(torch.bfloat16)


def _write_rows(write, slots: torch.Tensor, width: int, gen, device, pool: dict):
    """``write(rows (n, width) bf16, slots (n,))`` over ``slots`` in chunks; the random rows of a
    chunk size are drawn once (``pool``) and reused by every layer."""
    for s0 in range(0, slots.numel(), CHUNK_ROWS):
        sl = slots[s0:s0 + CHUNK_ROWS]
        key = (width, sl.numel())
        if key not in pool:
            pool[key] = _rand(gen, sl.numel(), width, device)
        write(pool[key], sl)


def fill_layer(ops, cfg, L: LayerCache, batch: int, ctx: int, swa_ring: int, gen: torch.Generator,
               pool: dict | None = None) -> None:
    """Fill one layer's caches to ``ctx`` tokens per request (see the module doc), through ``ops``'s
    writers (a :class:`ds4lab.model.ops.Backend`)."""
    pool = {} if pool is None else pool
    dev = L.swa.device
    b = torch.arange(batch, device=dev)
    n_swa = min(ctx, swa_ring)
    p = torch.arange(ctx - n_swa, ctx, device=dev)
    slots = (b[:, None] * swa_ring + p[None, :] % swa_ring).reshape(-1)
    _write_rows(lambda kv, s: ops.mla_cache_write(kv, s, L.swa, 64, "fill.swa_insert"), slots, cfg.head_dim, gen,
                dev, pool)
    if L.ratio:
        m = ctx // L.ratio
        if m:
            j = torch.arange(m, device=dev)
            cslots = (b[:, None] * L.n_comp + j[None, :]).reshape(-1)
            _write_rows(lambda kv, s: ops.mla_cache_write(kv, s, L.comp, L.comp_block, "fill.comp_insert"), cslots,
                        cfg.head_dim, gen, dev, pool)
            if L.ratio == 4:
                _write_rows(lambda k, s: ops.indexer_cache_write(k, s, L.idx, "fill.indexer_k_insert"), cslots,
                            cfg.index_head_dim, gen, dev, pool)
        L.state.normal_(generator=gen)
        if L.idx_state is not None:
            L.idx_state.normal_(generator=gen)


def fill_caches(model, caches: Caches, ctx: int, seed: int = 0) -> Caches:
    """Fill every layer (and the MTP layer) of ``caches`` to ``ctx`` tokens per request with
    ``model``'s backend writers; returns ``caches``. A following decode step runs at positions
    ``>= ctx``.

    Raises:
        ValueError: ``ctx`` not in ``[0, caches.max_ctx)`` (the step must still fit).
    """
    if not isinstance(ctx, int) or not 0 <= ctx < caches.max_ctx:
        raise ValueError(f"ctx={ctx!r}: expected an int in [0, max_ctx={caches.max_ctx}) (new_caches(batch, "
                         f"max_ctx) must leave room for the decode step)")
    dev = caches.layers[0].swa.device if caches.layers else model.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    pool: dict = {}
    layers = list(caches.layers) + ([caches.mtp] if caches.mtp is not None else [])
    for L in layers:
        fill_layer(model.ops, model.cfg, L, caches.batch, ctx, caches.swa_ring, gen, pool)
    return caches
