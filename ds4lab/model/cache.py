"""The paged caches of one rank, in vLLM 0.32's byte layouts (SPEC.md §3), and their slot maps.

Per layer (all replicated across TP ranks):

- ``swa``: fp8_ds_mla, 64 entries per block, block stride 37,440 B (``64*584`` padded to 576).
  A ring of ``swa_ring`` entries per request (a multiple of 64, >= window + the largest chunk):
  token ``pos`` of request ``b`` lives in slot ``b*swa_ring + pos % swa_ring``. vLLM's sliding
  window frees blocks behind the window the same way; the ring keeps memory flat at any ctx.
- ``comp`` (C4A/C128A): fp8_ds_mla compressed entries, 64 per block (C4) or 2 per block (C128,
  1,728 B stride); entry ``j`` of request ``b`` at slot ``b*n_comp + j``.
- ``idx`` (C4A): the indexer K cache, 64 entries per block, planar ``64x128`` e4m3 then 64 fp32
  scales, block stride 8,640 B; ``block_table[b, k] = b*n_comp/64 + k``.
- ``state`` / ``idx_state``: compressor states, float32 rows ``kv || score`` (``2*coff*hd`` wide),
  a ring of ``state_ring`` rows per request (window ``coff*ratio`` + the largest chunk).

Only ds4lab's writers fill them (``ds4lab_kernels.mla_cache`` / ``ds4lab_kernels.indexer`` or
their references, and the compressor op), through the model's ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LayerCache", "Caches", "new_caches", "mla_block_bytes", "IDX_BLOCK_BYTES", "swa_ring_size", "layer_sizes",
           "map_sizes"]

ENTRY = 584
IDX_BLOCK_BYTES = 8640


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def mla_block_bytes(block_size: int) -> int:
    """fp8_ds_mla block stride: ``block_size*584`` padded to a multiple of 576 (37,440 / 1,728 B)."""
    return _ceil(block_size * ENTRY, 576)


def swa_ring_size(cfg, chunk: int) -> int:
    """SWA ring entries per request: the window plus the largest chunk, rounded up to a block (64)."""
    return _ceil(cfg.sliding_window + chunk, 64)


def layer_sizes(cfg, ratio: int, max_ctx: int, chunk: int) -> tuple[int, int, int]:
    """A layer's static cache sizes ``(n_comp, state_ring, idx_state_ring)`` (0 where the layer has no
    such cache): compressed entries per request (``ceil(max_ctx / ratio)`` rounded up to the block, 64
    for C4 and 2 for C128), the compressor state ring (window ``coff*ratio`` + the largest chunk,
    rounded up to the ratio) and the C4 indexer compressor's ring (window 8 + the chunk)."""
    if not ratio:
        return 0, 0, 0
    coff = 2 if ratio == 4 else 1
    n = _ceil(-(-max_ctx // ratio), 64 if ratio == 4 else 2)
    ring = _ceil(coff * ratio + chunk, ratio)
    return n, ring, (_ceil(8 + chunk, 4) if ratio == 4 else 0)


def map_sizes(cfg, max_ctx: int, chunk: int = 256) -> tuple[int, tuple]:
    """``(swa_ring, layers)`` of the caches :func:`new_caches` makes, without allocating them:
    ``layers`` one ``(ratio, n_comp, state_ring, idx_state_ring)`` per decoder layer (what the
    step's index maps depend on; :meth:`Caches.map_sizes` reads the same from live caches)."""
    return swa_ring_size(cfg, chunk), tuple((r, *layer_sizes(cfg, r, max_ctx, chunk))
                                            for r in cfg.compress_ratios[:cfg.num_hidden_layers])


@dataclass
class LayerCache:
    ratio: int
    swa: torch.Tensor                       # uint8 (B*swa_ring/64, 37440)
    comp: torch.Tensor | None = None        # uint8 (blocks, stride)
    comp_block: int = 64
    n_comp: int = 0                         # compressed entries per request
    idx: torch.Tensor | None = None         # uint8 (blocks, 64, 132) view, stride(0) = 8640
    idx_block_table: torch.Tensor | None = None  # int32 (B, n_comp/64)
    state: torch.Tensor | None = None       # float32 (B*state_ring, 2*coff*hd)
    state_ring: int = 0
    idx_state: torch.Tensor | None = None   # float32 (B*state_ring4, 4*128)
    idx_state_ring: int = 0


@dataclass
class Caches:
    batch: int
    max_ctx: int
    swa_ring: int
    layers: list = field(default_factory=list)
    mtp: LayerCache | None = None

    def map_sizes(self) -> tuple:
        """``layers``: one ``(ratio, n_comp, state_ring, idx_state_ring)`` per decoder layer (the
        static sizes the step's index maps read; :func:`map_sizes` without caches)."""
        return tuple((L.ratio, L.n_comp, L.state_ring, L.idx_state_ring) for L in self.layers)


def _layer(cfg, ratio: int, B: int, max_ctx: int, swa_ring: int, chunk: int, device) -> LayerCache:
    hd = cfg.head_dim
    u8 = dict(dtype=torch.uint8, device=device)
    swa = torch.zeros(B * swa_ring // 64, mla_block_bytes(64), **u8)
    L = LayerCache(ratio=ratio, swa=swa)
    n, state_ring, idx_state_ring = layer_sizes(cfg, ratio, max_ctx, chunk)
    if ratio:
        coff = 2 if ratio == 4 else 1
        bs = 64 if ratio == 4 else 2
        L.comp, L.comp_block, L.n_comp = torch.zeros(B * n // bs, mla_block_bytes(bs), **u8), bs, n
        L.state_ring = state_ring
        L.state = torch.zeros(B * L.state_ring, 2 * coff * hd, dtype=torch.float32, device=device)
    if ratio == 4:
        ihd = cfg.index_head_dim
        nb = L.n_comp // 64
        buf = torch.zeros(B * nb, IDX_BLOCK_BYTES, **u8)
        L.idx = torch.as_strided(buf, (B * nb, 64, ihd + 4), (IDX_BLOCK_BYTES, ihd + 4, 1))
        L.idx_block_table = torch.arange(B * nb, dtype=torch.int32, device=device).reshape(B, nb)
        L.idx_state_ring = idx_state_ring
        L.idx_state = torch.zeros(B * L.idx_state_ring, 4 * ihd, dtype=torch.float32, device=device)
    return L


def new_caches(cfg, batch: int, max_ctx: int, chunk: int = 256, device="cpu") -> Caches:
    """Zeroed caches for ``batch`` requests of up to ``max_ctx`` tokens, prefill chunks of at most
    ``chunk`` tokens per request per step (decode: next_n <= 2)."""
    if batch < 1 or max_ctx < 1:
        raise ValueError(f"batch={batch}, max_ctx={max_ctx}: both must be >= 1")
    swa_ring = swa_ring_size(cfg, chunk)
    c = Caches(batch=batch, max_ctx=max_ctx, swa_ring=swa_ring)
    c.layers = [_layer(cfg, cfg.compress_ratios[i], batch, max_ctx, swa_ring, chunk, device)
                for i in range(cfg.num_hidden_layers)]
    if cfg.num_nextn_predict_layers:
        c.mtp = _layer(cfg, 0, batch, max_ctx, swa_ring, chunk, device)
    return c
