"""DeepSeek-V4 KV compressor, decode path (main attention hd 512, indexer hd 128; SPEC.md §2).

Semantics: vLLM 0.32 ``models/deepseek_v4/compressor.py`` ``DeepseekCompressor.forward``,
``common/ops/save_partial_states.py`` and ``common/ops/fused_compress_quant_cache.py``; the torch
reference is :mod:`ds4lab.reference.compressor`. Ratio ``r`` (4 or 128), ``coff = 2`` with overlap
(ratio 4) else 1, state rows ``kv || score`` of width ``2*coff*hd`` (float32).

Two launches per call (the default rows, ``launches`` 2):

1. ``_state_write_kernel``, grid ``(T,)``: program ``t`` writes token ``t``'s state row
   ``kv || score + ape[pos % r]`` into ``state[state_slots[t]]``.
2. ``_compress_kernel``, grid ``(T,)``: program ``t`` owns output row ``t`` (all ``hd`` dims). Off a
   boundary (``(pos + 1) % r != 0``) it stores zeros. On one it streams the ``coff*r`` window rows
   ``window_slots[t]`` in chunks of ``BLOCK_W`` with a per-dim online softmax over the scores
   (window element ``i`` reads the first ``hd`` half of its row when ``i < r``, the second when
   ``i >= r``; ``window_valid`` false = score ``-inf``), then RMSNorm (``eps``, ``norm_weight``),
   forward GPT-J RoPE on the last ``cos_sin.shape[1]`` dims at position ``(pos // r) * r``, bf16.

The split is the only cross-token dependency: an MTP step's second token's window holds the first
token's row, written by launch 1. The one-launch rows (``launches`` 1, ``<name>_1l``) remove it: launch 2
alone, each program first writes its own token's row, and a window row whose slot is one this launch
writes (``state_slots[u]``, found by comparing the chunk's slots with all ``T`` state slots) is built in
registers from ``kv_score[u]`` + ``ape[positions[u] % r]`` with the state write's operations (replacing
the ring's value), so no result depends on another program's write; same values, same chunks, same fp32
order: bit-identical to the pair.
Dims are handled as ``(hd/2, 2)`` pairs so the RoPE rotation of an (even, odd) pair stays inside one program.
"""
import torch
import triton
import triton.language as tl

from . import _checks as chk
from . import indexer as idx_cache
from . import mla_cache
from ._arch import arch_of
from .indexer import indexer_k_pack
from .mla_cache import fp8_ds_mla_pack

__all__ = ["compress_decode", "CONFIGS", "pick_config"]

RATIOS = (4, 128)
HEAD_DIMS = (128, 512)
#: the one-launch path searches this launch's state slots in blocks of 16, 32 or 64 tokens (decode: one block;
#: three specialisations instead of one per power of two)
MAX_BLOCK_T = 64


@triton.jit
def _state_row_write(ks_ptr, pos_ptr, slot_ptr, ape_ptr, st_ptr, stride_ks, stride_st, stride_ape, n_rows, t,
                     RATIO: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Token ``t``'s state row ``state[state_slots[t]]`` (``2*WIDTH`` fp32): ``kv`` copied,
    ``score + ape[pos % RATIO]``; a slot outside ``[0, n_rows)`` is skipped. The one home of the row's math
    (the fused kernel's window loads of this launch's rows repeat exactly these operations)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < n_rows):
        a_row = pos % RATIO
        c = tl.arange(0, BLOCK)
        m = c < WIDTH
        src = ks_ptr + t.to(tl.int64) * stride_ks
        dst = st_ptr + slot * stride_st
        kv = tl.load(src + c, mask=m, other=0.0).to(tl.float32)
        sc = tl.load(src + WIDTH + c, mask=m, other=0.0).to(tl.float32)
        a = tl.load(ape_ptr + a_row * stride_ape + c, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + c, kv, mask=m)
        tl.store(dst + WIDTH + c, sc + a, mask=m)


@triton.jit
def _state_write_kernel(ks_ptr, pos_ptr, slot_ptr, ape_ptr, st_ptr, stride_ks, stride_st, stride_ape, n_rows,
                        RATIO: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(T,)`` (the two-launch path's first launch).
    One program writes token ``t``'s state row (:func:`_state_row_write`)."""
    _state_row_write(ks_ptr, pos_ptr, slot_ptr, ape_ptr, st_ptr, stride_ks, stride_st, stride_ape, n_rows,
                     tl.program_id(0), RATIO, WIDTH, BLOCK)


@triton.jit
def _compress_kernel(st_ptr, pos_ptr, ws_ptr, wv_ptr, w_ptr, cs_ptr, out_ptr,
                     stride_st, stride_ws, stride_wv, stride_cs, stride_out, eps,
                     cslot_ptr, c_u8_ptr, c_f8_ptr, c_bf16_ptr, c_f32_ptr, c_stride, c_stride32, n_slots,
                     ks_ptr, ss_ptr, ape_ptr, stride_ks, stride_ape, n_rows, n_tok,
                     RATIO: tl.constexpr, COFF: tl.constexpr, HD: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_W: tl.constexpr, CACHE: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                     FUSED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(T,)``.
    One program owns output row ``t`` (all ``HD`` dims as ``(HD/2, 2)`` pairs): zeros off a boundary,
    else the online-softmax window sum over ``COFF*RATIO`` state rows, RMSNorm, GPT-J RoPE, bf16.
    ``CACHE`` 1 (HD 512) / 2 (HD 128): no output row; a boundary row is written as the fp8_ds_mla /
    indexer K entry of slot ``cslot_ptr[t]`` (``mla_cache.fp8_ds_mla_pack`` / ``indexer.indexer_k_pack``).
    ``FUSED`` (the one-launch path): the program first writes token ``t``'s own state row
    (:func:`_state_row_write`); a window row whose (clamped) slot is ``state_slots[u]`` of a token ``u`` of
    this launch (a valid slot; ``u`` = the largest such index, searched in ``BLOCK_T`` blocks of the
    ``n_tok`` slots) is built from ``kv_score[u]`` and ``ape[positions[u] % RATIO]`` with the state write's
    own operations and replaces what the ring load read there, so no result depends on another program's
    write (the ring load is issued unmasked by the search, keeping the search off its latency path)."""
    t = tl.program_id(0)
    if FUSED:
        _state_row_write(ks_ptr, pos_ptr, ss_ptr, ape_ptr, st_ptr, stride_ks, stride_st, stride_ape, n_rows, t,
                         RATIO, COFF * HD, COFF * HD)
    HALF: tl.constexpr = HD // 2
    W: tl.constexpr = COFF * RATIO
    WIDTH: tl.constexpr = COFF * HD
    j = tl.arange(0, HALF)
    k = tl.arange(0, 2)
    d = 2 * j[:, None] + k[None, :]                                   # (HALF, 2) dim index
    pos = tl.load(pos_ptr + t).to(tl.int64)
    orow = out_ptr + t.to(tl.int64) * stride_out
    if (pos + 1) % RATIO == 0:
        m = tl.full((HALF, 2), float("-inf"), tl.float32)
        l = tl.zeros((HALF, 2), tl.float32)
        acc = tl.zeros((HALF, 2), tl.float32)
        wi = tl.arange(0, BLOCK_W)
        for w0 in range(0, W, BLOCK_W):
            i = w0 + wi
            slot = tl.load(ws_ptr + t.to(tl.int64) * stride_ws + i).to(tl.int64)
            ok = tl.load(wv_ptr + t.to(tl.int64) * stride_wv + i) != 0
            slot = tl.maximum(slot, 0)
            if COFF == 2:
                col = tl.where(i >= RATIO, HD, 0)
            else:
                col = tl.zeros_like(i)
            base = st_ptr + slot[:, None, None] * stride_st + col[:, None, None] + d[None, :, :]
            ok3 = ok[:, None, None] & (d[None, :, :] >= 0)
            kv = tl.load(base, mask=ok3, other=0.0)
            sc = tl.load(base + WIDTH, mask=ok3, other=float("-inf"))
            if FUSED:        # rows this launch writes: from kv_score + ape (the state write's math), not the ring
                # (the ring loads above stay off the search's critical path; where a row is this launch's,
                # whatever they read is replaced)
                u = tl.full((BLOCK_W,), -1, tl.int32)
                tq = tl.arange(0, BLOCK_T)
                for u0 in range(0, n_tok, BLOCK_T):
                    uu = u0 + tq
                    ss = tl.load(ss_ptr + uu, mask=uu < n_tok, other=-1).to(tl.int64)
                    hit = (slot[:, None] == ss[None, :]) & ((ss >= 0) & (ss < n_rows))[None, :]
                    u = tl.maximum(u, tl.max(tl.where(hit, uu[None, :], -1), axis=1))
                mine = ok & (u >= 0)
                # masked loads in every chunk: a scalar "any such row in this chunk" branch put an 8-byte
                # stack frame (2 LDL/STL) on sm_120 c4_hd512_1l with the fp8_ds_mla write
                u64 = tl.maximum(u, 0).to(tl.int64)
                a_row = tl.load(pos_ptr + u64, mask=mine, other=0).to(tl.int64) % RATIO
                mine3 = mine[:, None, None] & (d[None, :, :] >= 0)
                off = col[:, None, None] + d[None, :, :]
                src = ks_ptr + u64[:, None, None] * stride_ks + off
                kv_u = tl.load(src, mask=mine3, other=0.0).to(tl.float32)
                sc_u = tl.load(src + WIDTH, mask=mine3, other=0.0).to(tl.float32)
                a_u = tl.load(ape_ptr + a_row[:, None, None] * stride_ape + off, mask=mine3, other=0.0).to(tl.float32)
                kv = tl.where(mine3, kv_u, kv)
                sc = tl.where(mine3, sc_u + a_u, sc)
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(sc - m_use[None, :, :])
            l = l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p * kv, axis=0)
            m = m_new
        c = acc / l
        ms = tl.sum(tl.sum(c * c, axis=1), axis=0) / HD
        w = tl.load(w_ptr + d).to(tl.float32)
        n = c * (1.0 / tl.sqrt_rn(ms + eps)) * w
        # GPT-J RoPE on the last ROPE dims: pair j rotates with cos_sin[cpos, j - (HALF - ROPE/2)]
        cpos = (pos // RATIO) * RATIO
        jr = j - (HALF - ROPE // 2)
        rm = jr >= 0
        cs_row = cs_ptr + cpos * stride_cs
        cos = tl.load(cs_row + jr, mask=rm, other=1.0).to(tl.float32)
        sin = tl.load(cs_row + ROPE // 2 + jr, mask=rm, other=0.0).to(tl.float32)
        ev = tl.sum(tl.where(k[None, :] == 0, n, 0.0), axis=1)
        od = tl.sum(tl.where(k[None, :] == 1, n, 0.0), axis=1)
        r_ev = ev * cos - od * sin
        r_od = od * cos + ev * sin
        y = tl.where(k[None, :] == 0, r_ev[:, None], r_od[:, None]).to(tl.bfloat16)
        if CACHE == 1:       # the entry as 8 tiles of 64 dims (row-major (HALF, 2) is dim order)
            slot = tl.load(cslot_ptr + t).to(tl.int64)
            fp8_ds_mla_pack(c_u8_ptr, c_f8_ptr, c_bf16_ptr, slot, n_slots, c_stride, tl.reshape(y, (8, 64)),
                            CACHE_BLOCK)
        elif CACHE == 2:     # one key row of HD dims
            slot = tl.load(cslot_ptr + t + tl.arange(0, 1)).to(tl.int64)
            indexer_k_pack(c_f8_ptr, c_f32_ptr, tl.reshape(y, (1, HD)).to(tl.float32), slot, slot >= 0, c_stride,
                           c_stride32, HD, CACHE_BLOCK)
        else:
            tl.store(orow + d, y)
    elif CACHE == 0:
        tl.store(orow + d, tl.zeros((HALF, 2), tl.bfloat16))


def compress_decode(kv_score: torch.Tensor, positions: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                    window_slots: torch.Tensor, window_valid: torch.Tensor, ape: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, ratio: int, cos_sin: torch.Tensor,
                    config: dict | None = None, *, cache: torch.Tensor | None = None,
                    cache_slots: torch.Tensor | None = None, block_size: int | None = None) -> torch.Tensor:
    """The compressor for one decode step: save the state rows, compress every boundary token;
    optionally write the entries straight into their cache (no output rows, no insert launch).

    Args:
        kv_score: ``(T, 2*coff*hd)`` float32 or bfloat16 ``kv || score`` (the ``wkv_gate`` GEMM
            output; bf16 is read and upcast in the state write, so the bf16 GEMM output needs no
            conversion launch), last dim contiguous, any row stride (a column slice of a fused GEMM's
            output); ``coff = 2`` for ratio 4, 1 for ratio 128; ``hd`` 512 or 128.
        positions: ``(T,)`` int32/int64 token positions (>= 0).
        state: ``(N, 2*coff*hd)`` float32 state ring (all requests), written in place.
        state_slots: ``(T,)`` int32/int64 row of ``state`` for each token (outside ``[0, N)``: skipped;
            valid slots distinct: which duplicate's row a window reads is unspecified).
        window_slots: ``(T, coff*ratio)`` int32/int64 state rows of positions
            ``pos - coff*ratio + 1 .. pos`` (negative entries are clamped to 0 and must be masked).
        window_valid: ``(T, coff*ratio)`` bool, False for window positions < 0.
        ape: ``(ratio, coff*hd)`` float32 absolute position embedding added to the scores.
        norm_weight: ``(hd,)`` RMSNorm weight (float32 or bf16). eps: RMSNorm epsilon.
        ratio: 4 or 128.
        cos_sin: ``(max_pos, R)`` float32 ``cos || sin`` table (R = 64 RoPE dims, GPT-J pairs).
        config: a row of ``CONFIGS`` to force (its ``launches``: 2 = state write + compress, 1 = one
            launch, bit-identical); default: :func:`pick_config` (by arch, ratio and hd; 2 launches).
        cache: None, or the cache that receives the entries, written in place: ``hd`` 512: an
            fp8_ds_mla cache (:func:`ds4lab_kernels.mla_cache.fp8_ds_mla_insert`'s layout, ``block_size``
            entries per block); ``hd`` 128: an indexer K cache
            (:func:`ds4lab_kernels.indexer.indexer_k_cache_insert`'s layout, its block size from its shape).
        cache_slots: with ``cache``: ``(T,)`` int32/int64 global slot of each token's entry. Written
            only where the row is on a boundary and the slot is valid (``>= 0``; fp8_ds_mla: also
            ``< num_blocks * block_size``; indexer K: the caller guarantees ``< num_blocks * block_size``,
            checked on the host for CPU tensors, as the insert); slots must be distinct.
        block_size: with an fp8_ds_mla ``cache``: entries per block (64 C4, 2 C128).

    Returns:
        ``(T, hd)`` bfloat16: the normed, rotated compressed entry on boundary rows
        (``(pos + 1) % ratio == 0``), zeros elsewhere (what the torch path returns). With ``cache``:
        the cache itself, holding, byte for byte, what the insert of those rows at ``cache_slots``
        (``-1`` off a boundary) writes.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes, strides, ratio, devices, head dim or a
            config's ``launches``; with
        ``cache``: a bad cache / ``block_size`` / ``cache_slots`` (named), a device without FP8.

    Semantics: :mod:`ds4lab.reference.compressor` (vLLM 0.32 ``DeepseekCompressor`` and the fused
    ``_fused_kv_compress_norm_rope_insert_*`` kernels, up to the cache write).
    """
    if ratio not in RATIOS:
        raise ValueError(f"ratio={ratio!r}: expected one of {RATIOS}")
    coff = 2 if ratio == 4 else 1
    chk.tensor("kv_score", kv_score, (torch.float32, torch.bfloat16), 2)
    width2 = kv_score.shape[1]
    if width2 % (2 * coff) or (width2 // (2 * coff)) not in HEAD_DIMS:
        raise ValueError(f"kv_score: width {width2} is not 2*coff*hd for coff={coff}, hd in {HEAD_DIMS}")
    hd = width2 // (2 * coff)
    T = kv_score.shape[0]
    chk.last_dim_contiguous("kv_score", kv_score)
    chk.tensor("positions", positions, (torch.int32, torch.int64), 1)
    chk.tensor("state", state, torch.float32, 2)
    chk.tensor("state_slots", state_slots, (torch.int32, torch.int64), 1)
    chk.tensor("window_slots", window_slots, (torch.int32, torch.int64), 2)
    chk.tensor("window_valid", window_valid, torch.bool, 2)
    chk.tensor("ape", ape, torch.float32, 2)
    chk.tensor("norm_weight", norm_weight, (torch.float32, torch.bfloat16), 1)
    chk.tensor("cos_sin", cos_sin, torch.float32, 2)
    if state.shape[1] != width2:
        raise ValueError(f"state: expected (N, {width2}) rows (2*coff*hd), got shape {tuple(state.shape)}")
    chk.last_dim_contiguous("state", state)
    chk.shape("positions", positions, (T,))
    chk.shape("state_slots", state_slots, (T,))
    W = coff * ratio
    chk.shape("window_slots", window_slots, (T, W))
    chk.shape("window_valid", window_valid, (T, W))
    chk.shape("ape", ape, (ratio, coff * hd))
    chk.last_dim_contiguous("ape", ape)
    chk.shape("norm_weight", norm_weight, (hd,))
    R = cos_sin.shape[1]
    if R % 2 or R > hd:
        raise ValueError(f"cos_sin: expected (max_pos, R) with even R <= {hd}, got {tuple(cos_sin.shape)}")
    chk.last_dim_contiguous("cos_sin", cos_sin)
    eps = chk.fp32_scalar("eps", eps, positive=True)
    chk.same_device("kv_score", kv_score, positions=positions, state=state, state_slots=state_slots,
                    window_slots=window_slots, window_valid=window_valid, ape=ape, norm_weight=norm_weight,
                    cos_sin=cos_sin)
    mode, cargs = _cache_args(cache, cache_slots, block_size, hd, T, kv_score)
    out = cache if mode else torch.empty(T, hd, dtype=torch.bfloat16, device=kv_score.device)
    if T == 0:
        return out
    positions, state_slots = positions.contiguous(), state_slots.contiguous()
    window_slots = window_slots.contiguous()
    wv = window_valid.contiguous().view(torch.uint8)
    norm_weight = norm_weight.contiguous()
    cfg = config or pick_config(ratio, hd, kv_score.device)
    fused = cfg.get("launches", 2) == 1
    if cfg.get("launches", 2) not in (1, 2):
        raise ValueError(f"config: launches={cfg['launches']!r}, expected 1 (one launch) or 2 (state write + compress)")
    width = coff * hd
    if not fused:
        _state_write_kernel[(T,)](kv_score, positions, state_slots, ape, state, kv_score.stride(0), state.stride(0),
                                  ape.stride(0), state.shape[0], RATIO=ratio, WIDTH=width,
                                  BLOCK=triton.next_power_of_2(width), num_warps=cfg["write_warps"])
    bw = min(cfg["BLOCK_W"], W)
    slots, u8, f8, bf, f32, cstride, cblock, n_slots = cargs
    _compress_kernel[(T,)](state, positions, window_slots, wv, norm_weight, cos_sin, state if mode else out,
                           state.stride(0), window_slots.stride(0), wv.stride(0), cos_sin.stride(0),
                           hd if mode else out.stride(0), eps, slots, u8, f8, bf, f32, cstride, cstride // 4,
                           n_slots, kv_score, state_slots, ape, kv_score.stride(0), ape.stride(0), state.shape[0], T,
                           RATIO=ratio, COFF=coff, HD=hd, ROPE=R, BLOCK_W=bw, CACHE=mode, CACHE_BLOCK=cblock,
                           FUSED=int(fused), BLOCK_T=_block_t(T) if fused else 1,
                           num_warps=cfg["num_warps"], num_stages=1)
    return out


def _block_t(T: int) -> int:
    return min(max(triton.next_power_of_2(T), 16), MAX_BLOCK_T)


def _cache_args(cache, cache_slots, block_size, hd: int, T: int, kv_score):
    """``(CACHE mode, (slots, u8, f8, bf16, f32 views, block stride bytes, block size, n_slots))`` of the
    cache write (mode 0: none, dummy pointers); the checks are the layouts' own writer checks."""
    if cache is None:
        if cache_slots is not None or block_size is not None:
            raise ValueError("cache_slots / block_size: given without cache")
        d = kv_score
        return 0, (d, d, d, d, d, 0, 1, 0)
    if cache_slots is None:
        raise ValueError("cache_slots: required with cache")
    who = "compress_decode(cache=...)"
    if hd == mla_cache.HEAD_DIM:
        if block_size is None:
            raise ValueError("block_size: required with an fp8_ds_mla cache (hd 512)")
        u8, f8, bf, stride, n_slots, slots = mla_cache.writer_args("cache", cache, block_size, "cache_slots",
                                                                   cache_slots, who, kv_score=kv_score)
        chk.shape("cache_slots", slots, (T,))
        if n_slots == 0:
            u8 = f8 = bf = kv_score          # an empty cache: every slot is skipped
        return 1, (slots, u8, f8, bf, kv_score, stride, block_size, n_slots)
    f8, f32, stride, bs, slots = idx_cache.writer_args("cache", cache, "cache_slots", cache_slots, T, who,
                                                       kv_score=kv_score)
    if block_size is not None and block_size != bs:
        raise ValueError(f"block_size={block_size!r}: the indexer K cache has {bs} entries per block")
    return 2, (slots, kv_score, f8, kv_score, f32, stride, bs, cache.shape[0] * bs)


# ---- config table ------------------------------------------------------------------------------
# One program per token, all hd dims (the RMSNorm needs them); the window streams in BLOCK_W-row
# chunks (BLOCK_W * hd * 2 fp32 per chunk in registers: 8 x 512 x 2 = 32 KB for 8 warps). Pure
# bandwidth: a C128 hd-512 boundary token reads 128 rows x 4 KB = 512 KB.
# ``launches``: 2 = state write + compress (the defaults); 1 = the one-launch rows ``<name>_1l``, the same
# BLOCK_W / num_warps (so the same fp32 reduction order: bit-identical to the pair), untimed on a GPU yet.
_ROWS = {
    "c4_hd512": {"BLOCK_W": 8, "num_warps": 8, "write_warps": 4},
    "c4_hd128": {"BLOCK_W": 8, "num_warps": 4, "write_warps": 2},
    "c128_hd512": {"BLOCK_W": 8, "num_warps": 8, "write_warps": 4},
    "c128_hd128": {"BLOCK_W": 32, "num_warps": 4, "write_warps": 2},
}
CONFIGS = {
    arch: {**{k: dict(v, launches=2) for k, v in _ROWS.items()},
           **{f"{k}_1l": dict(v, launches=1) for k, v in _ROWS.items()}}
    for arch in ("sm_89", "sm_90")
}


def pick_config(ratio: int, hd: int, device: torch.device, launches: int = 2) -> dict:
    """The table row for ``ratio`` / ``hd`` on ``device``'s arch; ``launches`` 2 (default: state write +
    compress) or 1 (the one-launch row)."""
    if launches not in (1, 2):
        raise ValueError(f"launches={launches!r}: expected 1 or 2")
    return CONFIGS[arch_of(device)][f"c{ratio}_hd{hd}" + ("_1l" if launches == 1 else "")]
