"""Sparse MLA decode / prefill with an attention sink (DeepSeek-V4, SPEC.md §2 items 6-7).

Semantics (FlashMLA ``flash_mla_with_kvcache`` sparse FP8 / ``flash_mla_sparse_fwd``, vLLM DeepSeek-V4
SWA + compressed attention): per query token ``t`` and head ``h``, over the candidates ``j`` (valid
SWA-window slots then valid compressed slots; ``-1`` and positions ``>= length`` are skipped),
``K = V =`` the 512-d latent, ``s_j = scale * q . k_j``, ``M = max(max_j s_j, sink_h)``,
``out = sum_j e^(s_j-M) v_j / (sum_j e^(s_j-M) + e^(sink_h-M))``; no candidate -> zeros.

Design: one program owns one token, ``BLOCK_H`` heads (the M dim of both ``tl.dot``s, so every
candidate tile is read once for all those heads) and one contiguous split of the candidate tiles.
A candidate tile is ``BLOCK_N`` slots: the 448 e4m3 NoPE bytes and the 7 UE8M0 bytes are read
straight from the fp8_ds_mla cache and dequantized in registers (exact in bf16), the 64 RoPE dims
are read as bf16, giving one ``(BLOCK_N, 512)`` bf16 tile used for ``S = Q K^T`` and ``O += P V``
(online softmax in base 2, fp32 accumulators). With more than one split, each split writes its
un-normalised ``O``, max and sum (fp32) and a second kernel merges them with the sink
(log-sum-exp merge). The split count depends only on tensor shapes (CUDA-graph safe).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import ue8m0_to_fp32
from .mla_cache import check_cache, flat_views

HEAD_DIM = 512
LOG2E = 1.4426950408889634
DEFAULT_SCALE = 512 ** -0.5


@triton.jit
def _gather_kv_raw(c_u8_ptr, c_bf16_ptr, idx, valid, stride_blk,
                   BS: tl.constexpr, KV_FP8: tl.constexpr, D: tl.constexpr):
    """(BLOCK_N,) slots -> the tile's raw loads ``(x, s, r)``: the (BLOCK_N, 512) e4m3 NoPE bytes, their
    UE8M0 scale bytes (one per 64 dims) and the bf16 RoPE dims (fp8_ds_mla), or the bf16 rows of a
    workspace in ``r`` (``KV_FP8=False``); invalid rows read nothing. :func:`_kv_from_raw` makes the tile."""
    d = tl.arange(0, D)[None, :]
    if KV_FP8:
        slot = idx.to(tl.int64)
        blk = slot // BS
        pos = slot - blk * BS
        base = blk * stride_blk
        ent = (base + pos * 576)[:, None]
        sc = (base + BS * 576 + pos * 8)[:, None]
        m = valid[:, None] & (d < 448)
        x = tl.load(c_u8_ptr + ent + d, mask=m, other=0)
        s = tl.load(c_u8_ptr + sc + d // 64, mask=m, other=0)
        r = tl.load(c_bf16_ptr + (ent + 448) // 2 + (d - 448), mask=valid[:, None] & (d >= 448), other=0.0)
    else:
        r = tl.load(c_bf16_ptr + idx.to(tl.int64)[:, None] * stride_blk + d, mask=valid[:, None], other=0.0)
        x = r
        s = r
    return x, s, r


@triton.jit
def _kv_from_raw(x, s, r, KV_FP8: tl.constexpr, D: tl.constexpr):
    """The raw loads of :func:`_gather_kv_raw` -> (BLOCK_N, 512) bf16 latent (fp8 x 2^e is exact in bf16)."""
    if KV_FP8:
        d = tl.arange(0, D)[None, :]
        xf = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k = tl.where(d < 448, (xf * ue8m0_to_fp32(s)).to(tl.bfloat16), r)
    else:
        k = r
    return k


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, c_u8_ptr, c_bf16_ptr, idx_row_ptr, n_idx, n_len, n_slots, stride_blk,
                  t_lo, t_hi, qk_scale,
                  BS: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """Online-softmax (base 2) accumulation over candidate tiles ``[t_lo, t_hi)`` of one source
    (``n_idx`` index columns, the first ``n_len`` valid). Index loads are masked by ``n_idx`` only, so
    they never wait for the length load. ``PREFETCH`` 1: the next tile's indices are loaded before
    this tile's math; 2: the next tile's raw cache entries too (after the first tile, the loads of
    tile t+1 are in flight under tile t's QK / softmax / PV)."""
    ar = tl.arange(0, BLOCK_N)
    if PREFETCH >= 1:
        idx_nx = tl.load(idx_row_ptr + t_lo * BLOCK_N + ar, mask=t_lo * BLOCK_N + ar < n_idx, other=-1)
        val_nx = (t_lo * BLOCK_N + ar < n_len) & (idx_nx >= 0) & (idx_nx < n_slots) & (t_lo < t_hi)
        if PREFETCH >= 2:
            x_nx, s_nx, r_nx = _gather_kv_raw(c_u8_ptr, c_bf16_ptr, idx_nx, val_nx, stride_blk, BS, KV_FP8, D)
    for t in range(t_lo, t_hi):
        if PREFETCH >= 1:
            valid = val_nx
            if PREFETCH >= 2:
                k = _kv_from_raw(x_nx, s_nx, r_nx, KV_FP8, D)
            else:
                x, sc, r = _gather_kv_raw(c_u8_ptr, c_bf16_ptr, idx_nx, valid, stride_blk, BS, KV_FP8, D)
                k = _kv_from_raw(x, sc, r, KV_FP8, D)
            offs_nx = (t + 1) * BLOCK_N + ar
            idx_nx = tl.load(idx_row_ptr + offs_nx, mask=offs_nx < n_idx, other=-1)
            val_nx = (offs_nx < n_len) & (idx_nx >= 0) & (idx_nx < n_slots) & (t + 1 < t_hi)
            if PREFETCH >= 2:
                x_nx, s_nx, r_nx = _gather_kv_raw(c_u8_ptr, c_bf16_ptr, idx_nx, val_nx, stride_blk, BS, KV_FP8, D)
        else:
            offs_n = t * BLOCK_N + ar
            idx = tl.load(idx_row_ptr + offs_n, mask=offs_n < n_idx, other=-1)
            valid = (offs_n < n_len) & (idx >= 0) & (idx < n_slots)
            x, sc, r = _gather_kv_raw(c_u8_ptr, c_bf16_ptr, idx, valid, stride_blk, BS, KV_FP8, D)
            k = _kv_from_raw(x, sc, r, KV_FP8, D)
        s = tl.dot(q, tl.trans(k)) * qk_scale                      # (BLOCK_H, BLOCK_N), log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)        # all -inf so far: keep zeros
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_heads(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, tok, offs_h, hmask, H, stride_ot,
                 stride_oh, S, d_lo, n_d, SB: tl.constexpr, ONE_PASS: tl.constexpr, HAS_LSE: tl.constexpr,
                 BLOCK_D: tl.constexpr, D: tl.constexpr):
    """LSE merge of one token's ``S`` split partials (``part (T, S, H, D)`` un-normalised fp32 ``O``,
    ``ml (T, S, H, 2)`` base-2 max and sum) with the sink, for heads ``offs_h`` and dims
    ``[d_lo, d_lo + n_d * BLOCK_D)``, summed in split order (bitwise deterministic, independent of
    which program finished first). ``ONE_PASS`` (``S <= SB``): the statistics are one ``(SB, BLOCK_H)``
    load and each dim chunk's partials one ``(SB, BLOCK_H, BLOCK_D)`` load, the next chunk's issued
    before this one is reduced; else ``SB`` splits per load in two passes (``n_d`` must be 1).
    Partials are read from L2 (``.cg``): other programs of this launch may have written them."""
    sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0) * 1.4426950408889634
    sb = tl.arange(0, SB)
    if ONE_PASS:
        prow = (tok * S + sb[:, None]) * H + offs_h[None, :]                # (SB, BLOCK_H)
        pm = (sb < S)[:, None] & hmask[None, :]
        ms = tl.load(ml_ptr + prow * 2, mask=pm, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(ml_ptr + prow * 2 + 1, mask=pm, other=0.0, cache_modifier=".cg")
        mc = tl.max(ms, 0)                                                  # max over the candidates only
    else:
        mc = tl.full(offs_h.shape, float("-inf"), tl.float32)
        for s0 in range(0, S, SB):
            s_ = s0 + sb
            prow = (tok * S + s_[:, None]) * H + offs_h[None, :]
            pm = (s_ < S)[:, None] & hmask[None, :]
            mc = tl.maximum(mc, tl.max(tl.load(ml_ptr + prow * 2, mask=pm, other=float("-inf"),
                                               cache_modifier=".cg"), 0))
    mx = tl.maximum(mc, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    mc_use = tl.where(mc == float("-inf"), 0.0, mc)
    if ONE_PASS:
        f = tl.where(pm, tl.exp2(ms - mx[None, :]), 0.0)
        den = tl.exp2(sink - mx) + tl.sum(ls * f, 0)
        lc = tl.sum(tl.where(pm, ls * tl.exp2(ms - mc_use[None, :]), 0.0), 0)  # candidates' sum at their max
        den_safe = tl.where(den > 0, den, 1.0)
        ar_d = tl.arange(0, BLOCK_D)
        pm3 = pm[:, :, None]
        x_nx = tl.load(part_ptr + prow[:, :, None] * D + (d_lo + ar_d)[None, None, :], mask=pm3, other=0.0,
                       cache_modifier=".cg")
        for c in range(0, n_d):
            x = x_nx
            nx_d = d_lo + (c + 1) * BLOCK_D + ar_d
            x_nx = tl.load(part_ptr + prow[:, :, None] * D + nx_d[None, None, :], mask=pm3 & (c + 1 < n_d),
                           other=0.0, cache_modifier=".cg")
            o = tl.sum(x * f[:, :, None], 0)
            o = tl.where((den > 0)[:, None], o / den_safe[:, None], 0.0)
            offs_d = d_lo + c * BLOCK_D + ar_d
            tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                     o.to(tl.bfloat16), mask=hmask[:, None])
    else:
        offs_d = d_lo + tl.arange(0, BLOCK_D)
        den = tl.exp2(sink - mx)
        lc = tl.zeros(offs_h.shape, tl.float32)
        o = tl.zeros((offs_h.shape[0], BLOCK_D), tl.float32)
        for s0 in range(0, S, SB):
            s_ = s0 + sb
            prow = (tok * S + s_[:, None]) * H + offs_h[None, :]
            pm = (s_ < S)[:, None] & hmask[None, :]
            ms = tl.load(ml_ptr + prow * 2, mask=pm, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(ml_ptr + prow * 2 + 1, mask=pm, other=0.0, cache_modifier=".cg")
            f = tl.where(pm, tl.exp2(ms - mx[None, :]), 0.0)
            den += tl.sum(ls * f, 0)
            lc += tl.sum(tl.where(pm, ls * tl.exp2(ms - mc_use[None, :]), 0.0), 0)
            x = tl.load(part_ptr + prow[:, :, None] * D + offs_d[None, None, :], mask=pm[:, :, None], other=0.0,
                        cache_modifier=".cg")
            o += tl.sum(x * f[:, :, None], 0)
        den_safe = tl.where(den > 0, den, 1.0)
        o = tl.where((den > 0)[:, None], o / den_safe[:, None], 0.0)
        tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(tl.bfloat16), mask=hmask[:, None])
    if HAS_LSE:  # natural-log LSE of the candidates only (sink outside), +inf without one
        if d_lo == 0:
            lse = tl.where(lc > 0, (mc_use + tl.log2(tl.where(lc > 0, lc, 1.0))) * 0.6931471805599453,
                           float("inf"))
            tl.store(lse_ptr + tok * H + offs_h, lse, mask=hmask)
            tl.store(mlog_ptr + tok * H + offs_h, mc * 0.6931471805599453, mask=hmask)


@triton.jit
def _sparse_mla_split_kernel(
    q_ptr, out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, cnt_ptr,
    a_u8_ptr, a_bf16_ptr, a_idx_ptr, a_len_ptr, a_stride_blk, a_slots, a_stride_it, a_n,
    b_u8_ptr, b_bf16_ptr, b_idx_ptr, b_len_ptr, b_stride_blk, b_slots, b_stride_it, b_n,
    H, stride_qt, stride_qh, stride_ot, stride_oh, qk_scale, tiles_per_split,
    A_BS: tl.constexpr, B_BS: tl.constexpr, HAS_B: tl.constexpr, KV_FP8: tl.constexpr,
    A_HAS_LEN: tl.constexpr, B_HAS_LEN: tl.constexpr, SPLITS, ONE_SPLIT: tl.constexpr, HAS_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    STATIC_BOUNDS: tl.constexpr, PREFETCH: tl.constexpr,
    FUSE: tl.constexpr, FUSE_SB: tl.constexpr, FUSE_BD: tl.constexpr,
):
    """Grid ``(cdiv(num_heads, BLOCK_H), SPLITS, num_tokens)``.
    One program: BLOCK_H heads of one token over one contiguous split of its candidate tiles
    (source A's tiles, then source B's). ``STATIC_BOUNDS``: the tile loop runs over the index
    columns, not the valid length (tiles past the length are masked out), so no load waits for the
    length load. ``FUSE`` (``SPLITS > 1``): after writing its partial, the program takes a ticket of
    its (token, head block) arrival counter (acq_rel, after a CTA barrier so every thread's stores
    are released); the one that draws the last ticket merges the ``SPLITS`` partials
    (:func:`_merge_heads`, split order) and resets the counter to 0 (no second launch, no memset,
    CUDA-graph replays find it zeroed)."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    tok = tl.program_id(2).to(tl.int64)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    t0 = sp * tiles_per_split
    t1 = t0 + tiles_per_split
    # source A (SWA window, or the prefill workspace): tiles [0, NT_A)
    a_len = a_n
    if A_HAS_LEN:
        a_len = tl.minimum(tl.maximum(tl.load(a_len_ptr + tok), 0), a_n)
    nt_a = tl.cdiv(a_n, BLOCK_N)
    if STATIC_BOUNDS:
        a_hi = tl.minimum(t1, nt_a)
    else:
        a_hi = tl.minimum(t1, tl.cdiv(a_len, BLOCK_N))
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, a_u8_ptr, a_bf16_ptr, a_idx_ptr + tok * a_stride_it,
                                  a_n, a_len, a_slots, a_stride_blk, t0, a_hi, qk_scale,
                                  A_BS, KV_FP8, BLOCK_N, D, PREFETCH)
    if HAS_B:
        # source B (compressed candidates): tiles [NT_A, NT_A + NT_B)
        b_len = b_n
        if B_HAS_LEN:
            b_len = tl.minimum(tl.maximum(tl.load(b_len_ptr + tok), 0), b_n)
        if STATIC_BOUNDS:
            b_hi = tl.minimum(t1 - nt_a, tl.cdiv(b_n, BLOCK_N))
        else:
            b_hi = tl.minimum(t1 - nt_a, tl.cdiv(b_len, BLOCK_N))
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, b_u8_ptr, b_bf16_ptr, b_idx_ptr + tok * b_stride_it,
                                      b_n, b_len, b_slots, b_stride_blk, tl.maximum(t0 - nt_a, 0), b_hi,
                                      qk_scale, B_BS, KV_FP8, BLOCK_N, D, PREFETCH)
    if ONE_SPLIT:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0) * 1.4426950408889634
        mx = tl.maximum(m_i, sink)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        f = tl.exp2(m_i - mx)
        den = l_i * f + tl.exp2(sink - mx)
        den_safe = tl.where(den > 0, den, 1.0)
        o = tl.where((den > 0)[:, None], acc * (f / den_safe)[:, None], 0.0)
        tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(tl.bfloat16), mask=hmask[:, None])
        if HAS_LSE:  # natural-log LSE of the candidates only (sink outside), +inf without one
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("inf"))
            tl.store(lse_ptr + tok * H + offs_h, lse, mask=hmask)
            tl.store(mlog_ptr + tok * H + offs_h, m_i * 0.6931471805599453, mask=hmask)
    else:
        row = (tok * SPLITS + sp) * H + offs_h                       # (T, SPLITS, H) rows
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None], cache_modifier=".cg")
        tl.store(ml_ptr + row * 2, m_i, mask=hmask, cache_modifier=".cg")
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask, cache_modifier=".cg")
        if FUSE:
            tl.debug_barrier()  # every thread's partial is written before the arrival is published
            cnt = cnt_ptr + tok * tl.num_programs(0) + hg
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                _merge_heads(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, tok, offs_h, hmask, H,
                             stride_ot, stride_oh, SPLITS, 0, D // FUSE_BD, FUSE_SB, True, HAS_LSE, FUSE_BD, D)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sparse_mla_merge_kernel(
    out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, H, stride_ot, stride_oh, S,
    SB: tl.constexpr, ONE_PASS: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, D: tl.constexpr,
):
    """Grid ``(cdiv(num_heads, BLOCK_H), D // BLOCK_D, num_tokens)``.
    One program: BLOCK_H heads x BLOCK_D dims of one token: merges the S split partials with the
    sink (:func:`_merge_heads`), so a token's merge is D // BLOCK_D programs wide and one
    (``ONE_PASS``) or a few dependent loads deep (not one program walking S x 512 floats)."""
    hg = tl.program_id(0)
    dg = tl.program_id(1)
    tok = tl.program_id(2).to(tl.int64)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    _merge_heads(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, tok, offs_h, offs_h < H, H,
                 stride_ot, stride_oh, S, dg * BLOCK_D, 1, SB, ONE_PASS, HAS_LSE, BLOCK_D, D)


# ---- launchers ---------------------------------------------------------------------------------
def _check_q(q, attn_sink, scale):
    check.tensor("q", q, torch.bfloat16)
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q: expected shape (num_tokens, num_heads, {HEAD_DIM}), got {tuple(q.shape)}")
    check.last_dim_contiguous("q", q)
    check.tensor("attn_sink", attn_sink, torch.float32)
    if tuple(attn_sink.shape) != (q.shape[1],):
        raise ValueError(f"attn_sink: expected shape ({q.shape[1]},) (num_heads), got {tuple(attn_sink.shape)}")
    check.same_device("q", q, attn_sink=attn_sink)
    # the kernel takes scale * log2(e) as an fp32 argument: a positive normal float32 that stays one
    if check.fp32_scalar("scale", scale, positive=True) * LOG2E > check.FP32_MAX:
        raise ValueError(f"scale={scale!r}: scale * log2(e) overflows float32")


def _check_idx(name, idx, lname, lens, q, optional_len=False):
    T = q.shape[0]
    check.tensor(name, idx, torch.int32)
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"{name}: expected shape ({T}, num_candidates), got {tuple(idx.shape)}")
    check.last_dim_contiguous(name, idx)
    check.same_device("q", q, **{name: idx})
    if lens is None:
        if not optional_len:
            raise ValueError(f"{lname}: required")
        return
    check.tensor(lname, lens, torch.int32)
    if tuple(lens.shape) != (T,) or (T and lens.stride(0) != 1):
        raise ValueError(f"{lname}: expected a contiguous ({T},) tensor, got shape {tuple(lens.shape)}")
    check.same_device("q", q, **{lname: lens})


def _splits(n_base: int, n_tiles: int, device, cfg: dict) -> int:
    if cfg.get("SPLITS"):
        return max(1, min(int(cfg["SPLITS"]), n_tiles))
    target = cfg.get("PROGS_PER_SM", 2) * num_sms(device)
    if n_base >= (target + 1) // 2:
        return 1
    per = max(cfg.get("MIN_TILES", 2), triton.cdiv(n_tiles * n_base, target))
    return max(1, min(triton.cdiv(n_tiles, per), cfg.get("MAX_SPLITS", n_tiles)))


# split arrival counters of the fused merge (``FUSE`` rows), one int32 per (token, head block), zero
# between launches (the last program of each resets its own); one buffer per device, grown outside
# CUDA-graph capture only
_COUNTERS: dict = {}
_MIN_COUNTERS = 4096
MERGE_ELEMS = 8192  # fp32 partial elements per (split, head, dim) load of a merge: 64 registers at 4 warps
MIN_MERGE_BD = 4    # a one-pass merge reads >= 16-byte runs of each partial row


def merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed ``int32`` arrival counters of the fused split merge on ``device`` (at least ``n``).

    Allocated once per device and left zero by every launch, so CUDA-graph replays reuse it. Fused
    launches must not run concurrently on two streams of one device (they share the counters).

    Raises:
        RuntimeError: the buffer would have to grow while a CUDA graph is being captured (run the
            same call once before capturing)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"sparse_mla_decode: the fused split merge needs {n} arrival counters on "
                               f"{device}; they are allocated on first use, which cannot happen during "
                               f"CUDA-graph capture (run the call once before capturing)")
        buf = torch.zeros(max(_MIN_COUNTERS, n), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def one_pass_merge(S: int, block_h: int):
    """``(SB, BLOCK_D)`` of a one-pass merge of ``S`` splits for ``block_h`` heads (every split's
    statistics in one load, ``SB * block_h * BLOCK_D <= MERGE_ELEMS``), or None when ``S`` is too large."""
    sb = triton.next_power_of_2(max(S, 1))
    bd = min(HEAD_DIM, MERGE_ELEMS // (sb * block_h))
    return (sb, bd) if bd >= MIN_MERGE_BD else None


def launch_plan(T: int, H: int, n_tiles: int, device, cfg: dict) -> dict:
    """How :func:`_launch` runs ``T`` tokens x ``H`` heads over ``n_tiles`` candidate tiles: splits,
    tiles per split, whether the merge is fused into the split launch (``launches`` 1) or a second
    launch, and the merge's split block / dim block. Depends on shapes and the config only."""
    BH = cfg["BLOCK_H"]
    n_hg = triton.cdiv(H, BH)
    S = _splits(T * n_hg, max(n_tiles, 1), device, cfg)
    tps = max(1, triton.cdiv(n_tiles, S))
    S = max(1, triton.cdiv(n_tiles, tps))
    plan = {"splits": S, "tiles_per_split": tps, "head_blocks": n_hg, "fused": False, "launches": 1}
    if S == 1:
        return plan
    if cfg.get("FUSE") and one_pass_merge(S, BH):
        sb, bd = one_pass_merge(S, BH)
        return {**plan, "fused": True, "merge_sb": sb, "merge_bd": bd, "merge_bh": BH}
    bhm = min(cfg.get("MERGE_BH", 16), triton.next_power_of_2(H))
    one = one_pass_merge(S, bhm) if cfg.get("MERGE_ONE_PASS") else None
    if one:
        sb, bd = one
    else:
        sb, bd = cfg.get("MERGE_SB", 8), cfg.get("MERGE_BD", 32)
    return {**plan, "launches": 2, "merge_sb": sb, "merge_bd": bd, "merge_bh": bhm, "merge_one_pass": bool(one)}


def _launch(q, srcs, attn_sink, scale, cfg, out, return_lse=False):
    """srcs: [(u8, bf16, idx, lens, stride_blk, n_slots, block_size)] (one or two sources)."""
    T, H, D = q.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=torch.bfloat16, device=q.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H, D) or (out.numel() and out.stride(2) != 1):
        raise ValueError(f"out: expected a bfloat16 ({T}, {H}, {D}) tensor with contiguous last dim")
    # return_lse: (max_logits, lse) rows, each (T, H) float32 contiguous, natural-log units
    stats = torch.empty((2, T, H), dtype=torch.float32, device=q.device) if return_lse else None
    if T == 0 or H == 0:
        return (out, stats) if return_lse else out
    BH, BN = cfg["BLOCK_H"], cfg["BLOCK_N"]
    n_tiles = sum(triton.cdiv(s[2].shape[1], BN) for s in srcs)
    plan = launch_plan(T, H, n_tiles, q.device, cfg)
    S, tps, n_hg, fused = plan["splits"], plan["tiles_per_split"], plan["head_blocks"], plan["fused"]
    a = srcs[0]
    b = srcs[1] if len(srcs) > 1 else srcs[0]
    if S > 1:
        part = torch.empty((T, S, H, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((T, S, H, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    cnt = merge_counters(q.device, T * n_hg) if fused else out  # unused unless fused
    sink = attn_sink.contiguous()
    a_len = a[3] if a[3] is not None else a[2]
    b_len = b[3] if b[3] is not None else b[2]
    lse_args = (stats[0], stats[1]) if return_lse else (sink, sink)
    _sparse_mla_split_kernel[(n_hg, S, T)](
        q, out, part, ml, sink, *lse_args, cnt,
        a[0], a[1], a[2], a_len, a[4], a[5], a[2].stride(0), a[2].shape[1],
        b[0], b[1], b[2], b_len, b[4], b[5], b[2].stride(0), b[2].shape[1],
        H, q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(scale) * LOG2E, tps,
        A_BS=a[6], B_BS=b[6], HAS_B=len(srcs) > 1, KV_FP8=a[0] is not None and a[0].dtype == torch.uint8,
        A_HAS_LEN=a[3] is not None, B_HAS_LEN=b[3] is not None, SPLITS=S, ONE_SPLIT=S == 1, HAS_LSE=return_lse,
        BLOCK_H=BH, BLOCK_N=BN, D=D, STATIC_BOUNDS=bool(cfg.get("STATIC_BOUNDS", False)),
        PREFETCH=int(cfg.get("PREFETCH", 0)), FUSE=fused, FUSE_SB=plan.get("merge_sb", 1) if fused else 1,
        FUSE_BD=plan.get("merge_bd", D) if fused else D,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    if plan["launches"] == 2:
        bhm, bd = plan["merge_bh"], plan["merge_bd"]
        _sparse_mla_merge_kernel[(triton.cdiv(H, bhm), D // bd, T)](
            out, part, ml, sink, *lse_args, H, out.stride(0), out.stride(1), S, SB=plan["merge_sb"],
            ONE_PASS=plan["merge_one_pass"], HAS_LSE=return_lse, BLOCK_H=bhm, BLOCK_D=bd, D=D,
            num_warps=cfg.get("MERGE_WARPS", 4), num_stages=1)
    return (out, stats) if return_lse else out


def sparse_mla_decode(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                      swa_lens: torch.Tensor, attn_sink: torch.Tensor,
                      comp_cache: torch.Tensor | None = None, comp_indices: torch.Tensor | None = None,
                      comp_lens: torch.Tensor | None = None, swa_block_size: int = 64,
                      comp_block_size: int = 64, scale: float = DEFAULT_SCALE,
                      out: torch.Tensor | None = None, config: dict | None = None,
                      return_lse: bool = False):
    """Sparse MLA decode over fp8_ds_mla caches (SWA window + compressed candidates) with a sink.

    Args:
        q: ``(num_tokens, num_heads, 512)`` bfloat16 (num_heads = 64/TP), last dim contiguous.
            MTP verification: the ``next_n`` query rows of a request are consecutive tokens, each
            with its own indices and lengths (``num_tokens = batch * next_n``).
        swa_cache: uint8 fp8_ds_mla cache ``(num_blocks, block_bytes)`` or
            ``(num_blocks, swa_block_size, 584)`` (per-block bytes contiguous; block stride from
            ``stride(0)``).
        swa_indices: ``(num_tokens, window)`` int32 global slots ``block*swa_block_size + pos``
            (window 128); ``-1`` skipped.
        swa_lens: ``(num_tokens,)`` int32: only the first ``swa_lens[t]`` indices are read
            (clamped to ``[0, window]``).
        attn_sink: ``(num_heads,)`` float32 per-head sink logit (natural-log units, unscaled).
        comp_cache / comp_indices / comp_lens: the compressed cache (same layout, block
            ``comp_block_size``: 64 for C4, 2 for C128), ``(num_tokens, Kc)`` int32 slots
            (C4A: Kc = 512 top-k; C128A: all compressed entries) and ``(num_tokens,)`` int32
            lengths (``None``: all Kc). ``comp_cache=None``: SWA-only layer.
        scale: softmax scale on ``q.k`` (default ``512^-0.5``).
        out: optional ``(num_tokens, num_heads, 512)`` bfloat16 output.
        config: a row of ``CONFIGS`` to force.
        return_lse: also return the log-sum-exp of the scores (FlashMLA convention).

    Returns:
        ``(num_tokens, num_heads, 512)`` bfloat16:
        ``sum_j e^(s_j-M) v_j / (sum_j e^(s_j-M) + e^(sink-M))``; a row with no valid candidate is
        zeros. Slots outside the cache are skipped like ``-1`` (no out-of-bounds reads).
        With ``return_lse``: ``(out, lse)``, lse ``(num_tokens, num_heads)`` float32 contiguous,
        ``ln sum_j e^(s_j)`` in natural-log units of the scaled scores, over the candidates only
        (the sink is outside the LSE), ``+inf`` for a row with no valid candidate (FlashMLA
        ``tests/ref.py::ref_sparse_attn_decode``). Taken from the split statistics: no extra pass.

    Raises:
        TypeError / ValueError naming the argument on wrong dtypes, shapes, strides, devices.

    Semantics: FlashMLA ``flash_mla_with_kvcache`` (sparse, FP8 KV, ``attn_sink``), vLLM
    DeepSeek-V4 sparse attention (SWA window + compressed top-k). CUDA-graph safe: no host sync,
    allocations depend on shapes only.
    """
    _check_q(q, attn_sink, scale)
    T, H, _ = q.shape
    dev = q.device
    sw_stride = check_cache("swa_cache", swa_cache, swa_block_size)
    check.same_device("q", q, swa_cache=swa_cache)
    _check_idx("swa_indices", swa_indices, "swa_lens", swa_lens, q)
    require_fp8("swa_cache", dev, "sparse_mla_decode (fp8_ds_mla cache)")
    su8, _, sbf = flat_views(swa_cache, sw_stride)
    srcs = [(su8, sbf, swa_indices, swa_lens, sw_stride, swa_cache.shape[0] * swa_block_size, swa_block_size)]
    if comp_cache is not None:
        c_stride = check_cache("comp_cache", comp_cache, comp_block_size)
        check.same_device("q", q, comp_cache=comp_cache)
        if comp_indices is None:
            raise ValueError("comp_indices: required with comp_cache")
        _check_idx("comp_indices", comp_indices, "comp_lens", comp_lens, q, optional_len=True)
        cu8, _, cbf = flat_views(comp_cache, c_stride)
        srcs.append((cu8, cbf, comp_indices, comp_lens, c_stride, comp_cache.shape[0] * comp_block_size,
                     comp_block_size))
    elif comp_indices is not None:
        raise ValueError("comp_indices: given without comp_cache")
    cfg = config or pick_config(H, dev, num_tokens=T)
    res = _launch(q, srcs, attn_sink, scale, cfg, out, return_lse=bool(return_lse))
    return (res[0], res[1][1]) if return_lse else res


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, attn_sink: torch.Tensor,
                       lengths: torch.Tensor | None = None, scale: float = DEFAULT_SCALE,
                       out: torch.Tensor | None = None, config: dict | None = None,
                       return_lse: bool = False):
    """Sparse MLA prefill over a bf16 gathered KV workspace with a sink.

    Args:
        q: ``(num_q_tokens, num_heads, 512)`` bfloat16, last dim contiguous.
        kv: ``(num_kv, 512)`` bfloat16 gathered latent workspace (K = V), last dim contiguous.
        indices: ``(num_q_tokens, Kc)`` int32 rows of ``kv``; ``-1`` (or ``>= num_kv``) skipped.
        attn_sink: ``(num_heads,)`` float32.
        lengths: optional ``(num_q_tokens,)`` int32 valid prefix of each index row (clamped to
            ``[0, Kc]``); ``None``: all Kc.
        scale: softmax scale (default ``512^-0.5``). out / config: as in :func:`sparse_mla_decode`.
        return_lse: also return ``max_logits`` and ``lse`` (FlashMLA ``flash_mla_sparse_fwd``).

    Returns:
        ``(num_q_tokens, num_heads, 512)`` bfloat16 (zeros for rows with no candidate). With
        ``return_lse``: ``(out, max_logits, lse)``, each statistic ``(num_q_tokens, num_heads)``
        float32 in natural-log units of the scaled scores over the candidates only (sink outside):
        ``max_logits`` ``-inf`` and ``lse`` ``+inf`` for a row with no candidate (FlashMLA
        ``tests/ref.py::ref_sparse_attn_fwd``).

    Raises:
        TypeError / ValueError naming the argument.

    Semantics: FlashMLA ``flash_mla_sparse_fwd`` with ``attn_sink`` (vLLM DeepSeek-V4 prefill).
    """
    _check_q(q, attn_sink, scale)
    T, H, D = q.shape
    check.tensor("kv", kv, torch.bfloat16)
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv: expected shape (num_kv, {D}), got {tuple(kv.shape)}")
    check.last_dim_contiguous("kv", kv)
    check.same_device("q", q, kv=kv)
    _check_idx("indices", indices, "lengths", lengths, q, optional_len=True)
    kv_arg = kv if kv.numel() else torch.zeros((1, D), dtype=kv.dtype, device=kv.device)
    srcs = [(None, kv_arg, indices, lengths, kv_arg.stride(0), kv.shape[0], 1)]
    cfg = config or pick_config(H, q.device)
    res = _launch(q, srcs, attn_sink, scale, cfg, out, return_lse=bool(return_lse))
    return (res[0], res[1][0], res[1][1]) if return_lse else res


# ---- config table ------------------------------------------------------------------------------
# BLOCK_H heads x BLOCK_N candidates per tile; the (BLOCK_N, 512) bf16 K/V tile is the shared
# memory user (BLOCK_N KiB per copy), the fp32 (BLOCK_H, 512) accumulator lives in registers
# (BLOCK_H*512*4 / (32*num_warps) bytes per thread), so wide head blocks need more warps.
# SPLITS=None: chosen from the shapes (about PROGS_PER_SM programs per SM, at least MIN_TILES
# tiles per split, at most MAX_SPLITS splits). The merge (S > 1) is its own launch,
# (heads/MERGE_BH, 512/MERGE_BD, tokens) programs wide, MERGE_SB splits per load; MERGE_ONE_PASS:
# every split's statistics and partials in one load each (launch_plan). FUSE: no second launch,
# the last-arriving split program of each (token, head block) merges. STATIC_BOUNDS: no load waits
# for the length load. PREFETCH 1/2: the next tile's indices / cache entries load under this tile's
# math. "m1" rows: MIN_TILES 1 (one tile per program at T=1: the shortest dependent chain, more
# partials for the parallel merge).
_T1 = {"MIN_TILES": 1, "MERGE_BD": 16, "MERGE_SB": 16}
_ONE = {"MIN_TILES": 1, "STATIC_BOUNDS": True, "MERGE_ONE_PASS": True}       # issue 20, attn5: T=1 rows
_FUSE = {"MIN_TILES": 1, "STATIC_BOUNDS": True, "PREFETCH": 2, "FUSE": True}
_ROWS = {
    "h16n16": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    "h16n16m1": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_T1},
    # candidates (issue 20, attn5; NOTES.md "Sparse MLA decode in one launch"): m1 with the length-free
    # chain and the one-pass merge, at 4 and 8 warps; h16n16 tiles (2+ per split) with the next tile
    # prefetched; the fused merge at <= 8 splits (the last arriver reads S x 32 KiB of partials)
    "h16n16m1o": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_ONE},
    "h16n16m1ow8": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, **_ONE},
    "h16n16p2": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PREFETCH": 2,
                 "MERGE_ONE_PASS": True},
    "h16n16f8": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_FUSE, "MAX_SPLITS": 8},
    # (an 8-warp h16n16f8 spilled 16 B on sm_90a at 64 heads, T=4: not in the table)
}
CONFIGS = {
    "sm_89": {
        **_ROWS,
        # h32n16 (never the sm_89 default) left the table: its one-pass form (SPLITS=1, what a 128-SM
        # RTX 4090 takes for prefill at 64 tokens x 64 heads) spills 8/4 B on sm_89 (ds4lab aot; the
        # split form the report used to build at 132 SMs does not)
    },
    "sm_90": {
        # ds4lab aot, ptxas for sm_90a: 64-head tiles (h64n32, h64n32p1, h64n32w16, h64n64: 131 KB smem,
        # 255 regs) spill 784-2824 B and h16n32 at one stage spills 8 B, so they left the table (their
        # H200 run-4 rows stay in results/bench.csv; NOTES.md "sparse MLA on sm_90 without spills").
        # h16n32s2, h16n32s2m1 and h32n32p1 lost every timed shape to h16n16 / h16n16m1 / h32n32 and left
        # the table too (NOTES.md "Sparse MLA decode in one launch" keeps their numbers).
        "h32n32": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
        **_ROWS,
    },
}

# Defaults per build: ``(max_heads, max_tokens, label)`` rows, the first whose bounds hold wins (None:
# any). Rows from timed runs of their own build only (H200, CUDA graph, cold L2, TP=4 rank, 16 heads;
# `DS4LAB_BENCH_SHAPES=targets|batched python3 -m ds4lab.harness.bench sparse_mla_decode --tp 4 --arch
# sm89|native`, session 5 rows in results/issue20/s5/):
# - sm_89 T=1: h16n16m1 12.27 / 9.79 / 14.70 us (C4A, C128A 8K, C128A 128K) vs h16n16 15.77 / 13.66 / 18.31;
#   T > 1 h16n16 (run 4). The 64-head (TP=1) T=1 rows of h16n16m1 are not timed on this build: h16n16 there.
# - sm_90 T <= 2 (16 heads): h16n16m1 (T=1 12.2 / 9.7 us; T=2 12.40 / 9.93 vs h16n16 15.86 / 13.64,
#   h16n32s2 37.4 / 36.5); 64 heads T=1 h16n16m1 14.9 us (issue 20, session 4); T > 2 (16 heads): h16n16
#   (T=16 26.9 / 14.8 us, T=32 38.8, C128A-128K T=32 65.6, vs h16n32s2 72.8 / 37.3 / 105.4 / 171.8 and h32n32
#   53.1 / 28.7 / 79.1 / 130.1); more heads at T > 1: h32n32 (run 4; the 64-head T > 1 rows not re-timed).
# The H200 sweep `OUT=DIR bash scripts/gpu/attn.sh` times every T=1 row in both builds and
# `python scripts/gpu/attn_pick.py DIR/bench.csv` prints the replacement lines from the winners.
DEFAULTS = {
    "sm_89": ((16, 1, "h16n16m1"), (None, None, "h16n16")),
    "sm_90": ((16, 2, "h16n16m1"), (None, 1, "h16n16m1"), (16, None, "h16n16"), (None, None, "h32n32")),
}

# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {a: tuple(dict.fromkeys(r[-1] for r in rows)) for a, rows in DEFAULTS.items()}


def pick_config(num_heads: int, device: torch.device, num_tokens: int | None = None) -> dict:
    """The first ``DEFAULTS`` row of ``device``'s build whose head and token bounds hold
    (``num_tokens=None``: prefill, read as a large token count)."""
    arch = arch_of(device)
    t = 1 << 30 if num_tokens is None else num_tokens
    for max_h, max_t, label in DEFAULTS[arch]:
        if (max_h is None or num_heads <= max_h) and (max_t is None or t <= max_t):
            return CONFIGS[arch][label]
    return CONFIGS[arch][DEFAULTS[arch][-1][-1]]
