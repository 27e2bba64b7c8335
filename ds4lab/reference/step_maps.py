"""Reference: the decode / prefill step's index maps (every index the step's layers need that depends
only on the tokens' positions and requests and the caches' static sizes), in torch.

Semantics: ds4lab's composition (:mod:`ds4lab.model.model`, its caches :mod:`ds4lab.model.cache`):
token ``t`` of request ``req[t]`` at position ``pos[t]``;

- SWA ring of ``swa_ring`` entries per request: the token's own slot ``req*swa_ring + pos % swa_ring``
  and its window ``max(0, pos-W+1) .. pos`` (``W`` = ``sliding_window``) as ring slots, -1 padded;
- a compressed cache of ``n_comp`` entries per request and ratio ``r``: entry ``(pos+1)//r - 1`` is
  written at a ratio boundary (``(pos+1) % r == 0``), ``(pos+1)//r`` entries exist after the token
  (vLLM's indexer bound), the request's first slot ``req*n_comp``; C128A attends all of them;
- a compressor state ring of ``ring`` rows per request: the window ``pos - coff*r + 1 .. pos``
  (``coff`` = 2 at ratio 4 (overlap), 1 at 128) as rows, masked below position 0, and the token's own row.

These are the torch ops the model ran inline (``RankModel._maps``, op group ``step.maps``), ~60
small launches; ``ds4lab_kernels.step_maps`` writes the same maps in one. Written for clarity: any
key structure, any integer positions (floor ``//`` and ``%``, as torch).
"""
from __future__ import annotations

import torch

__all__ = ["step_index_maps", "window_map"]


def window_map(pos: torch.Tensor, req: torch.Tensor, ratio: int, ring: int) -> dict:
    """The compressor's state rows for one ring size: token ``t``'s window
    ``pos - coff*ratio + 1 .. pos`` as ``wslots (T, coff*ratio)`` int64 rows ``req*ring + max(p, 0) % ring``,
    ``valid (T, coff*ratio)`` bool (``p >= 0``), and its own row ``sslots (T,)`` int64."""
    Wn = (2 if ratio == 4 else 1) * ratio
    win = pos[:, None] + torch.arange(1 - Wn, 1, device=pos.device)[None, :]
    return {"wslots": req[:, None] * ring + win.clamp_min(0) % ring, "valid": win >= 0,
            "sslots": req * ring + pos % ring}


def step_index_maps(positions: torch.Tensor, req: torch.Tensor, window: int, swa_ring: int, layers) -> dict:
    """Every index map of one step.

    Args:
        positions, req: ``(T,)`` int64 token positions and request ids.
        window: the sliding window ``W`` (128).
        swa_ring: SWA ring entries per request.
        layers: one ``(ratio, n_comp, state_ring, idx_state_ring)`` per layer (``Caches.map_sizes``);
            ratio 0 layers add nothing.

    Returns:
        ``{"swa_slots" (T,) int64, "swa_idx" (T, W) int32 (-1 padded), "swa_lens" (T,) int32,
        "comp": {(ratio, n_comp): ...}, "win": {(ratio, state_ring): ...}}`` with, per compressed-cache
        size: ``comp_w`` (T,) int64 write slot (-1 off a ratio boundary), ``ncomp`` (T,) int32 entries
        after the step's token, ``base`` (T, 1) int32 ``req * n_comp``; ratio 128 also ``slots``
        (T, n_comp) int32 and ``lens`` (T,) int32 (every entry, clamped count); per compressor state
        ring (:func:`window_map`): ``wslots``, ``valid``, ``sslots``. Layers of one ratio share one
        entry (their caches have equal sizes; the key holds the size, so differing sizes get their
        own; the C4 attention and indexer rings share one when equal). Keys in first-use layer order.
    """
    pos, W, R = positions, window, swa_ring
    start = (pos - (W - 1)).clamp_min(0)
    p = start[:, None] + torch.arange(W, device=pos.device)[None, :]
    swa_lens = (pos + 1 - start).to(torch.int32)
    swa_idx = torch.where(p <= pos[:, None], req[:, None] * R + p % R, -1).to(torch.int32)
    maps = {"swa_slots": req * R + pos % R, "swa_idx": swa_idx, "swa_lens": swa_lens, "comp": {}, "win": {}}
    p1 = pos + 1
    for r, n_comp, state_ring, idx_state_ring in layers:
        if not r:
            continue
        rings = [(r, state_ring)] + ([(4, idx_state_ring)] if r == 4 else [])
        for key in rings:
            if key not in maps["win"]:
                maps["win"][key] = window_map(pos, req, *key)
        key = (r, n_comp)
        if key in maps["comp"]:
            continue
        ncomp = p1 // r
        base = req * n_comp
        c = {"comp_w": torch.where(p1 % r == 0, base + ncomp - 1, -1), "ncomp": ncomp.to(torch.int32),
             "base": base.to(torch.int32)[:, None]}
        if r == 128:
            c["slots"] = c["base"] + torch.arange(n_comp, device=pos.device, dtype=torch.int32)[None, :]
            c["lens"] = ncomp.clamp_max(n_comp).to(torch.int32)
        maps["comp"][key] = c
    return maps
