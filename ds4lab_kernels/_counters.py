"""Zeroed int32 counter buffers for in-launch tickets and waits, one per (owner, device).

A kernel that counts arrivals (split-K tickets, a merge's workers) takes its counters from here and
leaves every one it used at 0 before it finishes, so the buffer stays zero between launches and
CUDA-graph replays. Each owner has its own buffer: launches of one owner must be stream-ordered on a
device (they share its counters); launches of different owners may run concurrently.
"""
from __future__ import annotations

import torch

_BUFFERS: dict = {}


def zeroed_counters(owner: str, device, n: int, min_slots: int = 4096) -> torch.Tensor:
    """At least ``n`` zeroed ``int32`` counters of ``owner`` (a kernel module's name) on ``device``.

    Allocated on first use (``max(n, min_slots)`` slots), grown when ``n`` is larger, never shrunk.

    Raises:
        RuntimeError: the buffer would have to be allocated or grown while a CUDA graph is being
            captured (run the same call once before capturing)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (owner, device.type, device.index)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: needs {n} counters on {device}; they are allocated on first use, "
                               "which cannot happen during CUDA-graph capture (run the call once before capturing)")
        buf = _BUFFERS[key] = torch.zeros(max(n, min_slots), dtype=torch.int32, device=device)
    return buf


def left_nonzero(owner: str | None = None) -> int:
    """Sum of |counter| over the buffers of ``owner`` (all owners: None): 0 when every launch reset its
    counters (a check for GPU scripts and tests)."""
    return sum(int(b.abs().sum()) for k, b in _BUFFERS.items() if owner is None or k[0] == owner)
