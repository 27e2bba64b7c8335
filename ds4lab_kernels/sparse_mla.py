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
from triton.runtime.interpreter import InterpretedFunction

from . import _checks as check
from ._arch import arch_of, num_sms, require_fp8
from ._counters import zeroed_counters
from ._fp8 import ue8m0_to_fp32
from .mla_cache import check_cache, flat_views
from .norm_rope import head_rmsnorm_rope
from . import o_proj as _oproj
from .o_proj import quant_store_rows, rope_back_cs, rope_back_cos_sin

HEAD_DIM = 512
LOG2E = 1.4426950408889634
DEFAULT_SCALE = 512 ** -0.5


@triton.jit
def _load_kv_tile(c_u8_ptr, c_bf16_ptr, idx, valid, stride_blk,
                  BS: tl.constexpr, KV_FP8: tl.constexpr, D: tl.constexpr):
    """(BLOCK_N,) slots -> (BLOCK_N, 512) bf16 latent; invalid rows are zeros."""
    d = tl.arange(0, D)[None, :]
    if KV_FP8:
        slot = idx.to(tl.int64)
        blk = slot // BS
        pos = slot - blk * BS
        base = blk * stride_blk
        ent = (base + pos * 576)[:, None]
        sc = (base + BS * 576 + pos * 8)[:, None]
        nope = d < 448
        m = valid[:, None] & nope
        x = tl.load(c_u8_ptr + ent + d, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = ue8m0_to_fp32(tl.load(c_u8_ptr + sc + d // 64, mask=m, other=0))
        r = tl.load(c_bf16_ptr + (ent + 448) // 2 + (d - 448), mask=valid[:, None] & (d >= 448), other=0.0)
        k = tl.where(nope, (x * s).to(tl.bfloat16), r)
    else:
        k = tl.load(c_bf16_ptr + idx.to(tl.int64)[:, None] * stride_blk + d, mask=valid[:, None], other=0.0)
    return k


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, c_u8_ptr, c_bf16_ptr, idx_row_ptr, n_len, n_slots, stride_blk,
                  t_lo, t_hi, qk_scale,
                  BS: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Online-softmax (base 2) accumulation over candidate tiles ``[t_lo, t_hi)`` of one source."""
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = offs_n < n_len
        idx = tl.load(idx_row_ptr + offs_n, mask=inb, other=-1)
        valid = inb & (idx >= 0) & (idx < n_slots)
        k = _load_kv_tile(c_u8_ptr, c_bf16_ptr, idx, valid, stride_blk, BS, KV_FP8, D)
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
def _sparse_mla_split_kernel(
    q_ptr, out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr,
    a_u8_ptr, a_bf16_ptr, a_idx_ptr, a_len_ptr, a_stride_blk, a_slots, a_stride_it, a_n,
    b_u8_ptr, b_bf16_ptr, b_idx_ptr, b_len_ptr, b_stride_blk, b_slots, b_stride_it, b_n,
    H, stride_qt, stride_qh, stride_ot, stride_oh, qk_scale, tiles_per_split,
    pos_ptr, cs_ptr, max_pos, q_eps,
    cnt_ptr, workers, m_x_ptr, m_xs_ptr, m_stride_xt, m_stride_xst, m_pos_ptr, m_cs_ptr, m_stride_cs, m_max_pos,
    m_eps,
    A_BS: tl.constexpr, B_BS: tl.constexpr, HAS_B: tl.constexpr, KV_FP8: tl.constexpr,
    A_HAS_LEN: tl.constexpr, B_HAS_LEN: tl.constexpr, SPLITS, ONE_SPLIT: tl.constexpr, HAS_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, Q_NORM: tl.constexpr, R: tl.constexpr,
    FUSED: tl.constexpr = False, M_SB: tl.constexpr = 8, M_BH: tl.constexpr = 16, M_BD: tl.constexpr = 32,
    M_OQ: tl.constexpr = False, M_ROPE: tl.constexpr = 64, M_SCALE_FMT: tl.constexpr = 2,
    M_EXACT: tl.constexpr = False,
):
    """Grid ``(cdiv(num_heads, BLOCK_H), SPLITS, num_tokens)``.
    One program: BLOCK_H heads of one token over one contiguous split of its candidate tiles.
    ``Q_NORM``: q is the raw ``wq_b`` output; the program norms its BLOCK_H heads (weight-free RMSNorm,
    ``q_eps``) and rotates their last ``R`` dims at ``positions[tok]`` (norm_rope's helper, the same
    float32 operations as ``rmsnorm_rope``), then rounds to bf16 as that launch's output would be.
    ``FUSED`` (SPLITS > 1; the merge in this launch): after storing its partial, a program takes a ticket
    on its (token, head block) counter ``cnt_ptr[tok * cdiv(H, BLOCK_H) + hg]``. The last ``workers``
    programs to arrive merge: worker ``w`` spins until all SPLITS partials are in, then runs
    :func:`_merge_tile` on merge tiles ``w, w + workers, ...`` of its head block (``M_BH`` heads x
    ``M_BD`` dims each, ``M_*`` as the merge kernel's constexprs, ``m_*`` its arguments). Only the last
    arrivals wait, and only for programs that have not yet arrived, so a launch cannot deadlock while the
    device holds more than ``groups x (workers - 1)`` programs at once (the launcher's bound). The last
    worker to finish resets the counter to 0."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    tok = tl.program_id(2).to(tl.int64)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    if Q_NORM:
        p = tl.load(pos_ptr + tok).to(tl.int64)
        q = head_rmsnorm_rope(q_ptr + tok * stride_qt + offs_h * stride_qh, hmask, p, cs_ptr, max_pos, q_eps,
                              D, R).to(tl.bfloat16)
    else:
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
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, a_u8_ptr, a_bf16_ptr, a_idx_ptr + tok * a_stride_it,
                                  a_len, a_slots, a_stride_blk,
                                  t0, tl.minimum(t1, tl.cdiv(a_len, BLOCK_N)), qk_scale,
                                  A_BS, KV_FP8, BLOCK_N, D)
    if HAS_B:
        # source B (compressed candidates): tiles [NT_A, NT_A + NT_B)
        b_len = b_n
        if B_HAS_LEN:
            b_len = tl.minimum(tl.maximum(tl.load(b_len_ptr + tok), 0), b_n)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, b_u8_ptr, b_bf16_ptr, b_idx_ptr + tok * b_stride_it,
                                      b_len, b_slots, b_stride_blk,
                                      tl.maximum(t0 - nt_a, 0),
                                      tl.minimum(t1 - nt_a, tl.cdiv(b_len, BLOCK_N)), qk_scale,
                                      B_BS, KV_FP8, BLOCK_N, D)
    if ONE_SPLIT:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0) * 1.4426950408889634
        mx = tl.maximum(m_i, sink)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        f = tl.exp2(m_i - mx)
        den = l_i * f + tl.exp2(sink - mx)
        den_safe = tl.where(den > 0, den, 1.0)
        o = tl.where((den > 0)[:, None], acc * (f / den_safe)[:, None], 0.0)
        if Q_NORM:
            # a position outside the table: NaN for the token (the q's NaN rope dims would become NaN
            # scores, which the den > 0 guard zeroes)
            o = tl.where((p >= 0) & (p < max_pos), o, float("nan"))
        tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(tl.bfloat16), mask=hmask[:, None])
        if HAS_LSE:  # natural-log LSE of the candidates only (sink outside), +inf without one
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("inf"))
            tl.store(lse_ptr + tok * H + offs_h, lse, mask=hmask)
            tl.store(mlog_ptr + tok * H + offs_h, m_i * 0.6931471805599453, mask=hmask)
    else:
        row = (tok * SPLITS + sp) * H + offs_h                       # (T, SPLITS, H) rows
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)
        if FUSED:
            c = cnt_ptr + tok * tl.num_programs(0) + hg
            tl.debug_barrier()                                        # every thread's partial stored
            ticket = tl.atomic_add(c, 1, sem="acq_rel", scope="gpu")
            w = ticket - (SPLITS - workers)
            if w >= 0:                                                # one of the last `workers` to arrive
                seen = ticket + 1
                while seen < SPLITS:
                    seen = tl.atomic_add(c, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()
                NBD: tl.constexpr = D // M_BD
                for u in range(w, (BLOCK_H // M_BH) * NBD, workers):
                    _merge_tile(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, H, stride_ot, stride_oh,
                                SPLITS, m_pos_ptr, m_max_pos, m_x_ptr, m_xs_ptr, m_stride_xt, m_stride_xst, m_cs_ptr,
                                m_stride_cs, m_eps, hg * BLOCK_H + (u // NBD) * M_BH, u % NBD, tok, M_SB, HAS_LSE,
                                M_BH, M_BD, D, Q_NORM, M_OQ, M_ROPE, M_SCALE_FMT, M_EXACT)
                if tl.atomic_add(c, 1, sem="relaxed", scope="gpu") == SPLITS + workers - 1:
                    tl.atomic_xchg(c, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_tile(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, H, stride_ot, stride_oh, S, pos_ptr, max_pos,
                x_ptr, xs_ptr, stride_xt, stride_xst, cs_ptr, stride_cs, eps, h0, dg, tok,
                SB: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                D: tl.constexpr, Q_NORM: tl.constexpr, OQ: tl.constexpr, ROPE: tl.constexpr,
                SCALE_FMT: tl.constexpr, EXACT: tl.constexpr):
    """Merge heads ``[h0, h0 + BLOCK_H)`` x dims ``[dg * BLOCK_D, (dg + 1) * BLOCK_D)`` of token ``tok`` over
    its S split partials with the sink (:func:`_sparse_mla_merge_kernel`'s program; the fused tail of
    :func:`_sparse_mla_split_kernel` runs it too)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = dg * BLOCK_D + tl.arange(0, BLOCK_D)
    sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0) * 1.4426950408889634
    if OQ:   # the rope chunk's cos/sin row (one per token, shared by its heads) gathered before the merge's
        # loads, so the epilogue waits on nothing but the merge; other chunks' loads are masked off
        NOPE: tl.constexpr = D - ROPE
        pq = tl.load(pos_ptr + tok).to(tl.int64)
        bad = (pq < 0) | (pq >= max_pos)
        pq = tl.where(bad, 0, pq)
        cosv, sinv = rope_back_cos_sin(offs_d, cs_ptr + pq * stride_cs, dg * BLOCK_D + BLOCK_D > NOPE, NOPE, ROPE // 2)
    sb = tl.arange(0, SB)
    mc = tl.full((BLOCK_H,), float("-inf"), tl.float32)                    # max over the candidates only
    for s0 in range(0, S, SB):
        s_ = s0 + sb
        prow = (tok * S + s_[:, None]) * H + offs_h[None, :]                # (SB, BLOCK_H)
        pm = (s_ < S)[:, None] & hmask[None, :]
        mc = tl.maximum(mc, tl.max(tl.load(ml_ptr + prow * 2, mask=pm, other=float("-inf")), 0))
    mx = tl.maximum(mc, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    mc_use = tl.where(mc == float("-inf"), 0.0, mc)
    den = tl.exp2(sink - mx)
    lc = tl.zeros((BLOCK_H,), tl.float32)                                  # candidates' sum at their own max
    o = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s0 in range(0, S, SB):
        s_ = s0 + sb
        prow = (tok * S + s_[:, None]) * H + offs_h[None, :]
        pm = (s_ < S)[:, None] & hmask[None, :]
        ms = tl.load(ml_ptr + prow * 2, mask=pm, other=float("-inf"))
        ls = tl.load(ml_ptr + prow * 2 + 1, mask=pm, other=0.0)
        f = tl.where(pm, tl.exp2(ms - mx[None, :]), 0.0)
        den += tl.sum(ls * f, 0)
        lc += tl.sum(tl.where(pm, ls * tl.exp2(ms - mc_use[None, :]), 0.0), 0)
        x = tl.load(part_ptr + prow[:, :, None] * D + offs_d[None, None, :], mask=pm[:, :, None], other=0.0)
        o += tl.sum(x * f[:, :, None], 0)
    den_safe = tl.where(den > 0, den, 1.0)
    o = tl.where((den > 0)[:, None], o / den_safe[:, None], 0.0)
    if Q_NORM:
        p = tl.load(pos_ptr + tok)
        o = tl.where((p >= 0) & (p < max_pos), o, float("nan"))
    if OQ:
        x = o.to(tl.bfloat16).to(tl.float32)                  # the bf16 o the plain mode stores
        if dg * BLOCK_D + BLOCK_D > NOPE:                     # the chunk holding the rope dims
            ev, od = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
            xp = tl.reshape(tl.join(od, ev), (BLOCK_H, BLOCK_D))    # x[d ^ 1]
            x = rope_back_cs(x, xp, offs_d, cosv[None, :], sinv[None, :], NOPE, EXACT)
        x = tl.where(bad, float("nan"), x)
        quant_store_rows(x, eps, x_ptr + tok * stride_xt + offs_h[:, None] * D + offs_d[None, :],
                         xs_ptr + tok * stride_xst + offs_h * (D // BLOCK_D) + dg, hmask, SCALE_FMT)
    else:
        tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(tl.bfloat16), mask=hmask[:, None])
    if HAS_LSE:  # natural-log LSE of the candidates only (sink outside), +inf without one
        if dg == 0:
            lse = tl.where(lc > 0, (mc_use + tl.log2(tl.where(lc > 0, lc, 1.0))) * 0.6931471805599453,
                           float("inf"))
            tl.store(lse_ptr + tok * H + offs_h, lse, mask=hmask)
            tl.store(mlog_ptr + tok * H + offs_h, mc * 0.6931471805599453, mask=hmask)


@triton.jit
def _sparse_mla_merge_kernel(
    out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, H, stride_ot, stride_oh, S, pos_ptr, max_pos,
    x_ptr, xs_ptr, stride_xt, stride_xst, cs_ptr, stride_cs, eps,
    SB: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, D: tl.constexpr, Q_NORM: tl.constexpr,
    OQ: tl.constexpr = False, ROPE: tl.constexpr = 64, SCALE_FMT: tl.constexpr = 2, EXACT: tl.constexpr = False,
):
    """Grid ``(cdiv(num_heads, BLOCK_H), D // BLOCK_D, num_tokens)``.
    One program: BLOCK_H heads x BLOCK_D dims of one token: merges the S split partials with the
    sink. The (max, sum) pairs and the partials are read SB splits at a time as
    ``(SB, BLOCK_H, BLOCK_D)`` tiles, so a token's merge is D // BLOCK_D programs wide and a few
    dependent loads deep (not one program walking S x 512 floats). ``Q_NORM``: a token whose
    position is outside the fused q norm's table (``[0, max_pos)``) gets NaN, as the one-split path.
    ``OQ`` (o_proj's input quant, BLOCK_D == 128 = one quant group): instead of the bf16 ``o``, the
    program writes ``inv_rope_fp8_quant``'s bytes of it: ``o`` rounded to bf16, the last ``ROPE`` dims
    of the head rotated back at ``positions[tok]`` (o_proj's ``rope_back_rows``, the pair partners by a
    register split/join; ``EXACT``: products in ``mul.rn`` so the fp-fusion build cannot contract them),
    NaN for a position outside the table, then ``quant_store_rows`` (e4m3 ``x`` + one scale per row)."""
    _merge_tile(out_ptr, part_ptr, ml_ptr, sink_ptr, mlog_ptr, lse_ptr, H, stride_ot, stride_oh, S, pos_ptr, max_pos,
                x_ptr, xs_ptr, stride_xt, stride_xst, cs_ptr, stride_cs, eps, tl.program_id(0) * BLOCK_H,
                tl.program_id(1), tl.program_id(2).to(tl.int64), SB, HAS_LSE, BLOCK_H, BLOCK_D, D, Q_NORM, OQ, ROPE,
                SCALE_FMT, EXACT)


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
    return max(1, triton.cdiv(n_tiles, per))


def _check_positions_table(q, positions, cos_sin, why):
    """``positions (T,)`` int32/int64 and a float32 2-D ``cos || sin`` table with rows, on q's device."""
    T = q.shape[0]
    if positions is None or cos_sin is None:
        raise ValueError(f"{'positions' if positions is None else 'cos_sin'}: required with {why}")
    check.tensor("positions", positions, (torch.int32, torch.int64))
    if tuple(positions.shape) != (T,):
        raise ValueError(f"positions: expected shape ({T},) (num_tokens), got {tuple(positions.shape)}")
    check.tensor("cos_sin", cos_sin, torch.float32)
    if cos_sin.dim() != 2 or cos_sin.shape[0] < 1:
        raise ValueError(f"cos_sin: expected a float32 (max_pos >= 1, R) cos || sin table, got shape "
                         f"{tuple(cos_sin.shape)}")
    check.same_device("q", q, positions=positions, cos_sin=cos_sin)


def _check_o_fp8(q, o_fp8, positions, cos_sin, heads_per_group, scale_fmt):
    """The fused o_proj input quant's arguments -> ``(heads_per_group, scale_fmt, rope_dim)`` or None."""
    if not isinstance(o_fp8, bool):
        raise TypeError(f"o_fp8: expected a bool, got {type(o_fp8).__name__}")
    if not o_fp8:
        return None
    _check_positions_table(q, positions, cos_sin, "o_fp8")
    T, H, D = q.shape
    if not isinstance(heads_per_group, int) or isinstance(heads_per_group, bool) or heads_per_group <= 0 \
            or H % heads_per_group:
        raise ValueError(f"heads_per_group={heads_per_group!r}: expected a positive int dividing num_heads={H}")
    if scale_fmt not in _oproj.SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected one of {_oproj.SCALE_FMTS}")
    R = cos_sin.shape[1]
    if R % 2 or R <= 0 or R > _oproj.QUANT_GROUP or R > D:
        raise ValueError(f"cos_sin: rope_dim={R} must be even, <= {_oproj.QUANT_GROUP} and <= head_dim={D} "
                         f"(o_fp8's inverse RoPE)")
    require_fp8("q", q.device, "sparse_mla_decode(o_fp8=True)")
    return heads_per_group, scale_fmt, R


def _check_q_norm(q, q_norm_eps, positions, cos_sin, o_fp8=False):
    """The fused q norm's arguments -> ``(eps, positions, cos_sin)`` (contiguous) or None (no norm);
    ``o_fp8``: positions / cos_sin also serve the output quant (checked there)."""
    if q_norm_eps is None:
        for n, t in (("positions", positions), ("cos_sin", cos_sin)):
            if t is not None and not o_fp8:
                raise ValueError(f"{n}: given without q_norm_eps or o_fp8 (the fused q norm + RoPE and "
                                 f"the output quant are off)")
        return None
    eps = check.fp32_scalar("q_norm_eps", q_norm_eps, nonnegative=True)
    _check_positions_table(q, positions, cos_sin, "q_norm_eps")
    D, R = q.shape[2], cos_sin.shape[1]
    if R < 2 or R > D or R & (R - 1):
        raise ValueError(f"cos_sin: expected a float32 (max_pos >= 1, R) cos || sin table with R a power of "
                         f"two in 2..{D}; got shape {tuple(cos_sin.shape)}")
    return eps, positions.contiguous(), cos_sin.contiguous()


#: the fused output quant's merge: programs of BLOCK_D = 128 dims (one quant group) and, by default,
#: OQ_MERGE_TILE // (MERGE_SB * 128) heads (the config may set OQ_MERGE_BH). 2048 since issue 20, session 20: with
#: the T=1 rows' MERGE_SB 16 that is one head a program, 16 x 4 = 64 programs at T=1 with 16 heads (4096: two heads,
#: 32 programs, the bf16 merge's count). The merge reads ~1.3 MB of fp32 partials at T=1 C4A (ncu, session 19: 8.38 us,
#: as long as the split); twice the programs halve each one's serial chain. Bit-equal to 4096 at the step's o_fp8
#: shapes, every case (scripts/gpu/merge_tile_check.py). Step ABBA (H100 80GB HBM3, results/issue20/s20/call1b and
#: call2, ``--ab sparse_mla.OQ_MERGE_TILE=2048``): sm_89 build batch 1 4,895 -> 4,857 us (attn.sparse_mla 531 -> 479),
#: batch-1 MTP 5,957 -> 5,892; native batch 1 5,586 -> 5,538; batch 16 within noise (8,837 -> 8,789 sm_89)
OQ_MERGE_TILE = 2048
OQ_EPS = 1e-10      # inv_rope_fp8_quant's (and o_proj's) amax floor


def fused_merge_workers(units: int, splits: int, groups: int, sms: int) -> int:
    """Programs of a (token, head block) group that merge in a ``FUSE_MERGE`` launch: as many as the group has
    merge tiles (``units``) and split programs (``splits``), and few enough that the spinning ones
    (``groups x (workers - 1)`` at most) leave a free SM (``sms``; one program each at least) for every
    program still to arrive, so the launch cannot deadlock. 1 in the interpreter (``sms`` = 1: programs
    run one after another, the last arrival of a group merges alone). Always >= 1."""
    return max(1, min(units, splits, (sms - 1) // max(groups, 1) + 1))


def _launch(q, srcs, attn_sink, scale, cfg, out, return_lse=False, q_norm=None, o_fp8=None, positions=None,
            cos_sin=None):
    """srcs: [(u8, bf16, idx, lens, stride_blk, n_slots, block_size)] (one or two sources);
    q_norm: None or ``(eps, positions, cos_sin)`` from :func:`_check_q_norm`; o_fp8: None or
    ``(heads_per_group, scale_fmt, rope_dim)`` from :func:`_check_o_fp8` (with ``positions``, ``cos_sin``):
    returns ``(x, x_s)`` (:func:`ds4lab_kernels.o_proj.inv_rope_fp8_quant`'s output for the bf16 o)."""
    T, H, D = q.shape
    if o_fp8 is not None:
        if out is not None:
            raise ValueError("out: not supported with o_fp8 (the output is the quantized (x, x_s) pair)")
        hpg, fmt, rope = o_fp8
        G = H // hpg
        x = torch.empty((T, G, hpg * D), dtype=torch.float8_e4m3fn, device=q.device)
        xs = torch.empty((T, G, hpg * D // _oproj.QUANT_GROUP), dtype=torch.uint8 if fmt == "ue8m0" else torch.float32,
                         device=q.device)
        positions, cos_sin = positions.contiguous(), cos_sin.contiguous()
    if out is None and o_fp8 is None:
        out = torch.empty((T, H, D), dtype=torch.bfloat16, device=q.device)
    elif out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H, D)
                              or (out.numel() and out.stride(2) != 1)):
        raise ValueError(f"out: expected a bfloat16 ({T}, {H}, {D}) tensor with contiguous last dim")
    # return_lse: (max_logits, lse) rows, each (T, H) float32 contiguous, natural-log units
    stats = torch.empty((2, T, H), dtype=torch.float32, device=q.device) if return_lse else None
    res = out if o_fp8 is None else (x, xs)
    if T == 0 or H == 0:
        return (res, stats) if return_lse else res
    BH, BN = cfg["BLOCK_H"], cfg["BLOCK_N"]
    n_hg = triton.cdiv(H, BH)
    n_tiles = sum(triton.cdiv(s[2].shape[1], BN) for s in srcs)
    S = _splits(T * n_hg, max(n_tiles, 1), q.device, cfg)
    tps = max(1, triton.cdiv(n_tiles, S))
    S = max(1, triton.cdiv(n_tiles, tps))
    a = srcs[0]
    b = srcs[1] if len(srcs) > 1 else srcs[0]
    if o_fp8 is not None and S == 1:
        # the one-split form (large T) writes bf16 o in the split kernel; the quant is its own launch
        out = torch.empty((T, H, D), dtype=torch.bfloat16, device=q.device)
    if S > 1:
        part = torch.empty((T, S, H, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((T, S, H, 2), dtype=torch.float32, device=q.device)
        if out is None:
            out = part  # o_fp8: the merge writes (x, x_s); no bf16 o (an unused pointer argument)
    else:
        part = ml = out  # unused
    sink = attn_sink.contiguous()
    a_len = a[3] if a[3] is not None else a[2]
    b_len = b[3] if b[3] is not None else b[2]
    eps, pos, cs = q_norm if q_norm is not None else (0.0, sink, sink)
    # "FUSE_MERGE": the merge runs in the split launch (its last arrivals; _sparse_mla_split_kernel's FUSED)
    fused = S > 1 and bool(cfg.get("FUSE_MERGE"))
    fk = {}
    margs = (sink, 1, sink, sink, 0, 0, sink, sink, 0, 0, 0.0)
    if S > 1:
        sb = cfg.get("MERGE_SB", 8)
        if o_fp8 is None:
            bhm = min(cfg.get("MERGE_BH", 16), triton.next_power_of_2(H))
            bd = cfg.get("MERGE_BD", 32)
            oq = dict(x_ptr=sink, xs_ptr=sink, stride_xt=0, stride_xst=0, cs_ptr=sink, stride_cs=0, eps=0.0)
            oqc = {}
        else:
            bd = _oproj.QUANT_GROUP
            bhm = min(cfg.get("OQ_MERGE_BH") or max(1, OQ_MERGE_TILE // (sb * bd)), triton.next_power_of_2(H))
            oq = dict(x_ptr=x, xs_ptr=xs, stride_xt=x.stride(0), stride_xst=xs.stride(0), cs_ptr=cos_sin,
                      stride_cs=cos_sin.stride(0), eps=OQ_EPS)
            oqc = dict(OQ=True, ROPE=rope, SCALE_FMT=_oproj._FMT_CODE[fmt],
                       EXACT=not isinstance(_sparse_mla_merge_kernel, InterpretedFunction))
        m_pos = positions if (o_fp8 is not None and q_norm is None) else pos
        max_pos = cs.shape[0] if q_norm is not None else (cos_sin.shape[0] if o_fp8 is not None else 0)
        if fused:
            bhm = min(bhm, BH)
            groups = T * n_hg
            sms = num_sms(q.device) if q.is_cuda and not isinstance(_sparse_mla_split_kernel, InterpretedFunction) \
                else 1
            workers = fused_merge_workers((BH // bhm) * (D // bd), S, groups, sms)
            fk = dict(FUSED=True, M_SB=sb, M_BH=bhm, M_BD=bd, **{"M_" + k: v for k, v in oqc.items()})
            margs = (zeroed_counters("sparse_mla", q.device, groups), workers, oq["x_ptr"], oq["xs_ptr"],
                     oq["stride_xt"], oq["stride_xst"], m_pos, oq["cs_ptr"], oq["stride_cs"], max_pos, oq["eps"])
    _sparse_mla_split_kernel[(n_hg, S, T)](
        q, out, part, ml, sink, *((stats[0], stats[1]) if return_lse else (sink, sink)),
        a[0], a[1], a[2], a_len, a[4], a[5], a[2].stride(0), a[2].shape[1],
        b[0], b[1], b[2], b_len, b[4], b[5], b[2].stride(0), b[2].shape[1],
        H, q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(scale) * LOG2E, tps,
        pos, cs,
        cs.shape[0] if q_norm is not None else 0, float(eps), *margs,
        A_BS=a[6], B_BS=b[6], HAS_B=len(srcs) > 1, KV_FP8=a[0] is not None and a[0].dtype == torch.uint8,
        A_HAS_LEN=a[3] is not None, B_HAS_LEN=b[3] is not None, SPLITS=S, ONE_SPLIT=S == 1, HAS_LSE=return_lse,
        BLOCK_H=BH, BLOCK_N=BN, D=D, Q_NORM=q_norm is not None, R=cs.shape[1] if q_norm is not None else 2, **fk,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    if S > 1 and not fused:
        _sparse_mla_merge_kernel[(triton.cdiv(H, bhm), D // bd, T)](
            out, part, ml, sink, *((stats[0], stats[1]) if return_lse else (sink, sink)), H, out.stride(0),
            out.stride(1), S, m_pos, max_pos, **oq, **oqc, SB=sb,
            HAS_LSE=return_lse, BLOCK_H=bhm, BLOCK_D=bd, D=D, Q_NORM=q_norm is not None,
            num_warps=cfg.get("MERGE_WARPS", 4), num_stages=1)
    if S == 1 and o_fp8 is not None:
        res = _oproj.inv_rope_fp8_quant(out, positions, cos_sin, hpg, True, fmt, eps=OQ_EPS, check_positions=False,
                                        config=_oproj.unfused3_config(q.device).get("rope") if q.is_cuda else None)
    return (res, stats) if return_lse else res


def sparse_mla_decode(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                      swa_lens: torch.Tensor, attn_sink: torch.Tensor,
                      comp_cache: torch.Tensor | None = None, comp_indices: torch.Tensor | None = None,
                      comp_lens: torch.Tensor | None = None, swa_block_size: int = 64,
                      comp_block_size: int = 64, scale: float = DEFAULT_SCALE,
                      out: torch.Tensor | None = None, config: dict | None = None,
                      return_lse: bool = False, q_norm_eps: float | None = None,
                      positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                      o_fp8: bool = False, heads_per_group: int = 8, scale_fmt: str = "ue8m0"):
    """Sparse MLA decode over fp8_ds_mla caches (SWA window + compressed candidates) with a sink.

    Args:
        q: ``(num_tokens, num_heads, 512)`` bfloat16 (num_heads = 64/TP), last dim contiguous, any
            token and head strides (e.g. a column slice of a fused GEMM output, viewed per head).
            MTP verification: the ``next_n`` query rows of a request are consecutive tokens, each
            with its own indices and lengths (``num_tokens = batch * next_n``). With ``q_norm_eps``:
            the raw ``wq_b`` output, normed and rotated in the kernel's q load (below).
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
        q_norm_eps: None (q used as given), or the epsilon of DeepSeek-V4's per-head q RMSNorm: each
            program loads its heads' raw q, computes ``q * rsqrt(mean(q^2) + eps)`` (no weight) and
            the GPT-J interleaved RoPE of the last ``R`` dims at ``positions`` in float32 (the helper
            :func:`ds4lab_kernels.norm_rope.head_rmsnorm_rope`, the same operations as
            ``rmsnorm_rope(q, None, eps, positions, cos_sin)``) and rounds to bfloat16 before the
            attention, replacing that launch. Requires ``positions`` ``(num_tokens,)`` int32/int64
            (a position outside ``[0, cos_sin.shape[0])`` makes that token's output NaN, every head,
            never a finite value from an unrotated q; no host sync to check it) and ``cos_sin`` float32 ``(max_pos, R)`` ``cos || sin``
            (:func:`ds4lab.reference.rope.cos_sin_cache`, R = 64 here, a power of two <= 512).
        o_fp8: False (bf16 ``o``), or True: return o_proj's quantized input instead, exactly what
            ``o_proj.inv_rope_fp8_quant(o, positions, cos_sin, heads_per_group, True, scale_fmt,
            check_positions=False)`` returns for this call's bf16 ``o`` (same shapes, dtypes, layout, bits):
            ``o`` rounded to bf16, the last ``R`` dims of each head rotated back by ``-theta`` at
            ``positions`` (``cos_sin`` ``(max_pos, R)`` float32, R even <= 128; the same table as
            ``q_norm_eps``'s when both are on), 1x128 e4m3 quant with ``scale_fmt`` scales; a position
            outside the table makes that token's ``x`` and scales NaN (no host check: graph safe). Written
            by the merge launch's epilogue (the decode sizes always split), so o_proj's inverse RoPE + quant
            launch disappears; the one-split form (large ``T``) writes bf16 ``o`` and runs that launch
            itself. ``out`` must be None.
        heads_per_group: with ``o_fp8``: heads per ``wo_a`` group (8 for DeepSeek-V4), dividing num_heads.
        scale_fmt: with ``o_fp8``: ``"fp32"``, ``"pow2"`` or ``"ue8m0"`` (uint8 exponent bytes; the model's).

    Returns:
        ``(num_tokens, num_heads, 512)`` bfloat16:
        ``sum_j e^(s_j-M) v_j / (sum_j e^(s_j-M) + e^(sink-M))``; a row with no valid candidate is
        zeros. Slots outside the cache are skipped like ``-1`` (no out-of-bounds reads).
        With ``return_lse``: ``(out, lse)``, lse ``(num_tokens, num_heads)`` float32 contiguous,
        ``ln sum_j e^(s_j)`` in natural-log units of the scaled scores, over the candidates only
        (the sink is outside the LSE), ``+inf`` for a row with no valid candidate (FlashMLA
        ``tests/ref.py::ref_sparse_attn_decode``). Taken from the split statistics: no extra pass.
        With ``o_fp8``: ``(x, x_s)`` in place of ``out`` (``x`` ``(num_tokens, num_heads/heads_per_group,
        heads_per_group*512)`` float8_e4m3fn, ``x_s`` ``(..., heads_per_group*4)`` uint8 (ue8m0) or float32,
        both contiguous); with ``return_lse`` too: ``(x, x_s, lse)``.

    Raises:
        TypeError / ValueError naming the argument on wrong dtypes, shapes, strides, devices.

    Semantics: FlashMLA ``flash_mla_with_kvcache`` (sparse, FP8 KV, ``attn_sink``), vLLM
    DeepSeek-V4 sparse attention (SWA window + compressed top-k); the fused q norm is the Q side
    of vLLM's ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``. CUDA-graph safe: no host
    sync, allocations depend on shapes only.
    """
    _check_q(q, attn_sink, scale)
    oq = _check_o_fp8(q, o_fp8, positions, cos_sin, heads_per_group, scale_fmt)
    q_norm = _check_q_norm(q, q_norm_eps, positions, cos_sin, o_fp8=oq is not None)
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
    res = _launch(q, srcs, attn_sink, scale, cfg, out, return_lse=bool(return_lse), q_norm=q_norm, o_fp8=oq,
                  positions=positions, cos_sin=cos_sin)
    if return_lse:
        return (*res[0], res[1][1]) if oq is not None else (res[0], res[1][1])
    return res


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
# tiles per split). The merge (S > 1) is its own launch, (heads/MERGE_BH, 512/MERGE_BD, tokens)
# programs wide, MERGE_SB splits per load. "m1" rows: MIN_TILES 1 (one tile per program at T=1:
# the shortest dependent chain, more partials for the parallel merge); T=1 candidates.
_T1 = {"MIN_TILES": 1, "MERGE_BD": 16, "MERGE_SB": 16}
CONFIGS = {
    "sm_89": {
        "h16n16": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        "h16n16m1": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_T1},
        # "f" rows (issue 20, session 19): the merge in the split launch (FUSE_MERGE; any row takes the key); slower on the H100 (T=1 C4A
        # 13.59 vs 12.22 us, step batch 1 +156 us; NOTES "Session 19"), kept as candidates
        "h16n16m1f": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_T1, "FUSE_MERGE": True},
        # h32n16 (never the sm_89 default) left the table: its one-pass form (SPLITS=1, what a 128-SM
        # RTX 4090 takes for prefill at 64 tokens x 64 heads) spills 8/4 B on sm_89 (ds4lab aot; the
        # split form the report used to build at 132 SMs does not)
    },
    "sm_90": {
        # ds4lab aot, ptxas for sm_90a: 64-head tiles (h64n32, h64n32p1, h64n32w16, h64n64: 131 KB smem,
        # 255 regs) spill 784-2824 B and h16n32 at one stage spills 8 B, so they left the table (their
        # H200 run-4 rows stay in results/bench.csv; NOTES.md "sparse MLA on sm_90 without spills").
        # h16n32s2: the h16n32 tile with two stages, no spill; h32n32p1: one program per SM (split target).
        "h16n32s2": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        "h32n32": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
        "h32n32p1": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PROGS_PER_SM": 1},
        # T=1 candidates (issue 20): the sm_89 tile on sm_90 (16 candidates per tile: half the
        # dependent gather per program), and both with one tile per split
        "h16n16": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        "h16n16m1": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_T1},
        "h16n16m1f": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **_T1, "FUSE_MERGE": True},
        "h16n32s2m1": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **_T1},
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
    "sm_89": ((16, 2, "h16n16m1"), (None, None, "h16n16")),
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
