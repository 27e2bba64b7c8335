"""Torch reference for the indexer's top-k selection (SPEC.md §2 item 5; vLLM ``top_k_per_row``).

Row ``r`` of ``logits`` ``(num_rows, N)`` has ``lengths[r]`` valid leading entries (default N).
NaN counts as ``-inf``; ``-inf`` entries are never selected. The result is ``min(k, #selectable)``
distinct indices in ``[0, length)`` followed by ``-1`` padding. Tie rule: among equal scores the
LOWER index wins. Selected indices are listed in ascending index order (not by score).
"""
from __future__ import annotations

import torch

__all__ = ["topk_indices"]


def topk_indices(logits: torch.Tensor, k: int = 512, lengths: torch.Tensor | None = None) -> torch.Tensor:
    x = logits.detach().cpu().double()
    R, N = x.shape
    x = torch.where(x.isnan(), torch.full_like(x, float("-inf")), x)
    lens = torch.full((R,), N) if lengths is None else lengths.detach().cpu().long().clamp(0, N)
    out = torch.full((R, k), -1, dtype=torch.int32)
    for r in range(R):
        row = x[r, :int(lens[r])]
        valid = (row > float("-inf")).nonzero().squeeze(1)
        if len(valid) == 0:
            continue
        # stable sort by (-score, index): the lower index wins ties
        order = torch.sort(-row[valid], stable=True).indices
        sel = torch.sort(valid[order[:k]]).values
        out[r, :len(sel)] = sel.to(torch.int32)
    return out
