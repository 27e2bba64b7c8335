"""The decode / prefill step's index maps in ONE launch (DeepSeek-V4 composition, issue 20).

Semantics: the torch reference :mod:`ds4lab.reference.step_maps` (``step_index_maps``): from the
step's positions and requests and the caches' static sizes, every index the step's layers read:
the SWA slot and window of each token, per compressed-cache size the write slot, entry count,
request base and (C128A) the slot list, per compressor state ring the window rows, their validity
and the token's own row. The reference runs ~60 small torch ops; this kernel writes every map of a
token in one program (grid ``(T,)``), all sizes constexpr, integer math in int64 with floor
``//`` / ``%`` (torch's semantics for any sign; Triton's integer ops truncate), so the maps are
bit-identical to the reference.

Key structure covered (:func:`covers`): layers of ratio 0, 4 and 128, one compressed-cache size
and one state ring per ratio, one indexer ring at ratio 4 (equal to the main ring: one shared
entry, as the reference's dict keys it). Anything else (e.g. two ``n_comp`` for one ratio) is a
``ValueError`` here; the model's kernel backend checks :func:`covers` first and keeps the torch
reference for it.
"""
import functools

import torch
import triton
import triton.language as tl

from . import _checks as chk
from ._arch import arch_of

__all__ = ["step_index_maps", "covers", "CONFIGS", "GPU_DEFAULTS", "pick_config"]

RATIOS = (0, 4, 128)


@triton.jit
def _floor_mod(a, m: tl.constexpr):
    """``a mod m`` in ``[0, m)`` for ``m > 0`` (Python / torch floor semantics; ``%`` truncates)."""
    r = a % m
    return tl.where(r < 0, r + m, r)


@triton.jit
def _window_rows(t, pos, req, wslots_ptr, valid_ptr, sslots_ptr, WN: tl.constexpr, RING: tl.constexpr):
    """Token ``t``'s compressor state rows for one ring: window ``pos - WN + 1 .. pos`` as
    ``req*RING + max(p, 0) mod RING`` (int64), ``p >= 0`` (bool), and its own row."""
    j = tl.arange(0, WN)
    p = pos + 1 - WN + j
    tl.store(wslots_ptr + t * WN + j, req * RING + _floor_mod(tl.maximum(p, 0), RING))
    tl.store(valid_ptr + t * WN + j, p >= 0)
    tl.store(sslots_ptr + t, req * RING + _floor_mod(pos, RING))


@triton.jit
def _comp_counts(t, pos, req, w_ptr, ncomp_ptr, base_ptr, RATIO: tl.constexpr, N: tl.constexpr):
    """Token ``t``'s compressed-cache counts for ratio ``RATIO``, ``N`` entries per request: write
    slot (int64, -1 off a boundary), entries after the token (int32), ``req*N`` (int32); returns the
    entry count (int64) for the caller's clamped length."""
    p1 = pos + 1
    rem = _floor_mod(p1, RATIO)
    ncomp = (p1 - rem) // RATIO          # exact division: floor(p1 / RATIO) for any sign
    base = req * N
    tl.store(w_ptr + t, tl.where(rem == 0, base + ncomp - 1, -1))
    tl.store(ncomp_ptr + t, ncomp.to(tl.int32))
    tl.store(base_ptr + t, base.to(tl.int32))
    return ncomp


@triton.jit
def _step_maps_kernel(
    pos_ptr, req_ptr, stride_pos, stride_req,
    swa_slots_ptr, swa_idx_ptr, swa_lens_ptr,
    w4_ws_ptr, w4_v_ptr, w4_s_ptr, w4i_ws_ptr, w4i_v_ptr, w4i_s_ptr, w128_ws_ptr, w128_v_ptr, w128_s_ptr,
    c4_w_ptr, c4_n_ptr, c4_b_ptr, c128_w_ptr, c128_n_ptr, c128_b_ptr, c128_slots_ptr, c128_lens_ptr,
    W: tl.constexpr, SWA_RING: tl.constexpr, N4: tl.constexpr, RING4: tl.constexpr, RING4I: tl.constexpr,
    N128: tl.constexpr, RING128: tl.constexpr, CHUNK: tl.constexpr,
):
    """Grid ``(T,)``.
    One program owns token ``t``'s entry of every map: SWA slot / window / length, the ratio-4
    (``N4 > 0``) and ratio-128 (``N128 > 0``) compressed-cache counts and the C128 slot list, and the
    state rows of the ratio-4 ring (``RING4``), the distinct indexer ring (``RING4I > 0``) and the
    ratio-128 ring (``RING128``). Rows wider than ``CHUNK`` (the SWA window, the C128 slot list) are
    written ``CHUNK`` at a time."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos)
    req = tl.load(req_ptr + t * stride_req)
    # SWA: own slot, window max(0, pos-W+1) .. pos as ring slots (-1 padded), length
    start = tl.maximum(pos - (W - 1), 0)
    tl.store(swa_slots_ptr + t, req * SWA_RING + _floor_mod(pos, SWA_RING))
    tl.store(swa_lens_ptr + t, (pos + 1 - start).to(tl.int32))
    for c0 in range(0, W, CHUNK):
        j = c0 + tl.arange(0, CHUNK)
        p = start + j                      # >= 0
        v = tl.where(p <= pos, req * SWA_RING + p % SWA_RING, -1)
        tl.store(swa_idx_ptr + t * W + j, v.to(tl.int32), mask=j < W)
    if N4 > 0:
        _window_rows(t, pos, req, w4_ws_ptr, w4_v_ptr, w4_s_ptr, 8, RING4)
        if RING4I > 0:
            _window_rows(t, pos, req, w4i_ws_ptr, w4i_v_ptr, w4i_s_ptr, 8, RING4I)
        _comp_counts(t, pos, req, c4_w_ptr, c4_n_ptr, c4_b_ptr, 4, N4)
    if N128 > 0:
        _window_rows(t, pos, req, w128_ws_ptr, w128_v_ptr, w128_s_ptr, 128, RING128)
        ncomp = _comp_counts(t, pos, req, c128_w_ptr, c128_n_ptr, c128_b_ptr, 128, N128)
        tl.store(c128_lens_ptr + t, tl.minimum(ncomp, N128).to(tl.int32))
        base = (req * N128).to(tl.int32)
        for c0 in range(0, N128, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            tl.store(c128_slots_ptr + t * N128 + j, base + j, mask=j < N128)


def _structure(layers):
    """``layers`` -> ``(sizes, win_keys, comp_keys, why)``: ``sizes`` the kernel's constexprs
    ``{ratio: (n_comp, state_ring, idx_state_ring)}``, the dict keys in the reference's first-use
    order, and ``why`` ('' when the kernel covers the structure, else the reason). Raises
    ValueError for a malformed entry. Cached per ``layers`` (a step's caches keep their sizes)."""
    try:
        rows = tuple(tuple(L) for L in layers)
        hash(rows)
    except TypeError:
        raise TypeError(f"layers: expected a sequence of (ratio, n_comp, state_ring, idx_state_ring) tuples, "
                        f"got {type(layers).__name__}") from None
    return _analyse(rows)


@functools.lru_cache(maxsize=64)
def _analyse(rows: tuple):
    sizes, win, comp, why = {}, [], [], ""
    for i, L in enumerate(rows):
        if len(L) != 4 or not all(isinstance(v, int) and not isinstance(v, bool) for v in L):
            raise ValueError(f"layers[{i}]={L!r}: expected (ratio, n_comp, state_ring, idx_state_ring) ints")
        r, n, ring, iring = L
        if not r:
            continue
        if r not in RATIOS:
            why = why or f"layers[{i}]: ratio {r} (the kernel covers {RATIOS[1:]})"
            continue
        if n < 1 or ring < 1 or (r == 4 and iring < 1):
            raise ValueError(f"layers[{i}]={L!r}: n_comp, state_ring (and idx_state_ring at ratio 4) must be >= 1")
        s = (n, ring, iring if r == 4 else 0)
        if sizes.setdefault(r, s) != s:
            why = why or f"layers[{i}]: ratio {r} sizes {s} differ from an earlier layer's {sizes[r]}"
        for key in [(r, ring)] + ([(4, iring)] if r == 4 else []):
            if key not in win:
                win.append(key)
        if (r, n) not in comp:
            comp.append((r, n))
    return sizes, tuple(win), tuple(comp), why


def covers(layers) -> bool:
    """True when :func:`step_index_maps` covers this key structure (see the module doc)."""
    return not _structure(layers)[3]


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}: expected a positive int")
    return v


def step_index_maps(positions: torch.Tensor, req: torch.Tensor, window: int, swa_ring: int, layers,
                    config: dict | None = None) -> dict:
    """Every index map of one step, in one launch.

    Args:
        positions: ``(T,)`` int64 token positions (any stride).
        req: ``(T,)`` int64 request ids, same device.
        window: the sliding window ``W`` (``sliding_window``, 128).
        swa_ring: SWA ring entries per request (``Caches.swa_ring``).
        layers: one ``(ratio, n_comp, state_ring, idx_state_ring)`` per layer (``Caches.map_sizes()``),
            a structure :func:`covers` accepts.
        config: a row of ``CONFIGS`` to force; default picks by arch.

    Returns:
        The reference's dict (:func:`ds4lab.reference.step_maps.step_index_maps`): ``swa_slots (T,)``
        int64, ``swa_idx (T, W)`` int32, ``swa_lens (T,)`` int32, ``comp {(ratio, n_comp): {comp_w (T,)
        int64, ncomp (T,) int32, base (T, 1) int32[, slots (T, n_comp) int32, lens (T,) int32]}}``,
        ``win {(ratio, ring): {wslots (T, coff*ratio) int64, valid (T, coff*ratio) bool, sslots (T,)
        int64}}``; the same keys, dtypes, shapes and values, contiguous. No host sync (CUDA-graph
        capturable); shapes depend only on ``T`` and the sizes.

    Raises:
        TypeError: wrong tensor dtypes / kinds. ValueError: wrong shapes or devices, non-positive
        sizes, a malformed ``layers`` entry or a key structure the kernel does not cover.
    """
    chk.tensor("positions", positions, torch.int64, ndim=1)
    chk.tensor("req", req, torch.int64, ndim=1)
    chk.shape("req", req, positions.shape)
    chk.same_device("positions", positions, req=req)
    W = _pos_int("window", window)
    R = _pos_int("swa_ring", swa_ring)
    sizes, win_keys, comp_keys, why = _structure(layers)
    if why:
        raise ValueError(f"layers: key structure not covered by the kernel ({why}); use "
                         f"ds4lab.reference.step_maps.step_index_maps")
    T, dev = positions.shape[0], positions.device
    i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
    maps = {"swa_slots": torch.empty(T, **i64), "swa_idx": torch.empty(T, W, **i32),
            "swa_lens": torch.empty(T, **i32), "comp": {}, "win": {}}
    win = {}
    for key in win_keys:
        wn = (2 if key[0] == 4 else 1) * key[0]
        win[key] = {"wslots": torch.empty(T, wn, **i64), "valid": torch.empty(T, wn, dtype=torch.bool, device=dev),
                    "sslots": torch.empty(T, **i64)}
    comp = {}
    for r, n in comp_keys:
        comp[(r, n)] = {"comp_w": torch.empty(T, **i64), "ncomp": torch.empty(T, **i32),
                        "base": torch.empty(T, 1, **i32)}
        if r == 128:
            comp[(r, n)].update(slots=torch.empty(T, n, **i32), lens=torch.empty(T, **i32))
    maps["win"], maps["comp"] = win, comp
    if T == 0:
        return maps
    n4, ring4, iring4 = sizes.get(4, (0, 0, 0))
    n128, ring128, _ = sizes.get(128, (0, 0, 0))
    dummy = maps["swa_slots"]   # pointer for a map the constexprs switch off (never touched)
    w4 = win.get((4, ring4), {})
    w4i = win.get((4, iring4), {}) if iring4 != ring4 else {}
    w128 = win.get((128, ring128), {})
    c4, c128 = comp.get((4, n4), {}), comp.get((128, n128), {})

    def ptrs(d, names):
        return [d.get(k, dummy) for k in names]
    cfg = config or pick_config(T, dev)
    _step_maps_kernel[(T,)](
        positions, req, positions.stride(0), req.stride(0),
        maps["swa_slots"], maps["swa_idx"], maps["swa_lens"],
        *ptrs(w4, ("wslots", "valid", "sslots")), *ptrs(w4i, ("wslots", "valid", "sslots")),
        *ptrs(w128, ("wslots", "valid", "sslots")),
        *ptrs(c4, ("comp_w", "ncomp", "base")), *ptrs(c128, ("comp_w", "ncomp", "base", "slots", "lens")),
        W=W, SWA_RING=R, N4=n4, RING4=ring4, RING4I=iring4 if iring4 != ring4 else 0,
        N128=n128, RING128=ring128, CHUNK=cfg["CHUNK"], num_warps=cfg["num_warps"], num_stages=1)
    return maps


# ---- config table ------------------------------------------------------------------------------
# A few hundred bytes per token (at 32k ctx: ~3 KB with the C128 slot list): pure launch latency. One
# warp writes a 256-wide chunk at 8 int32 per thread; "w4" (4 warps, 1,024-wide chunks) is the row for
# long contexts (C128 slot lists of 1,024+ entries at 128k). Defaults untimed until the H200 bench.
CONFIGS = {
    "sm_89": {"w1": {"CHUNK": 256, "num_warps": 1}, "w4": {"CHUNK": 1024, "num_warps": 4}},
    "sm_90": {"w1": {"CHUNK": 256, "num_warps": 1}, "w4": {"CHUNK": 1024, "num_warps": 4}},
}
GPU_DEFAULTS = {"sm_89": ("w1",), "sm_90": ("w1",)}


def pick_config(num_tokens: int, device: torch.device) -> dict:
    return CONFIGS[arch_of(device)]["w1"]
